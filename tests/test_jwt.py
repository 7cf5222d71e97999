"""JWT/OIDC bearer tokens beside API keys (policy ``auth.jwt``): the hostile
tokens a verifier must refuse, each 401 or 403 and never a 500; a token's
claims as the key id and tier of quotas and models; the key set read off the
request path, refreshed on rotation at most once a minute, and kept while
its source is down. Real processes, a real Redis, a real HTTP key server."""

import asyncio
import base64
import contextlib
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from infergate.gateway.errors import ApiError
from infergate.gateway.jwks import KeySet, parse_key_set, read_source
from infergate.gateway.tokens import Verifier
from infergate.policies import PolicyError, parse_policy
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from tests.helpers import SECRETS, as_yaml, auth, http, policy, wait_for

ISSUER, AUDIENCE = "https://idp.example", "infergate"


class Provider:
    """An identity provider: an RSA key and an EC key, its JWKS, and tokens."""

    def __init__(self) -> None:
        self.rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ec = ec.generate_private_key(ec.SECP256R1())
        self.kids = {"r1": self.rsa, "e1": self.ec}

    def jwks(self) -> dict[str, Any]:
        keys = []
        for kid, key in self.kids.items():
            algorithm = RSAAlgorithm if isinstance(key, rsa.RSAPrivateKey) else ECAlgorithm
            jwk = json.loads(algorithm.to_jwk(key.public_key()))
            keys.append({**jwk, "kid": kid, "use": "sig"})
        return {"keys": keys}

    def token(self, kid: str = "r1", alg: str | None = None, **claims: Any) -> str:
        key = self.kids[kid]
        alg = alg or ("RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256")
        return jwt.encode(_claims(**claims), key, algorithm=alg, headers={"kid": kid})

    def public_pem(self) -> bytes:
        return self.rsa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )


def _claims(**claims: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "tier": "paid", "exp": now + 600}
    base.update(claims)
    return {k: v for k, v in base.items() if v is not None}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned(header: dict[str, Any], claims: dict[str, Any], signature: bytes = b"") -> str:
    return ".".join(
        (_b64(json.dumps(header).encode()), _b64(json.dumps(claims).encode()), _b64(signature))
    )


@pytest.fixture(scope="module")
def idp() -> Provider:
    return Provider()


def jwt_policy(jwks: dict[str, Any], path: Path, **jwt_fields: Any) -> str:
    if "jwks_url" not in jwt_fields:
        path.write_text(json.dumps(jwks))
        jwt_fields["jwks_file"] = str(path)
    doc = policy(tiers={"free": {"rate_limits": ["2/minute"]}})
    doc["auth"] = {"jwt": {"issuer": ISSUER, "audience": AUDIENCE, **jwt_fields}}
    return as_yaml(doc)


def verifier(idp: Provider, tmp_path: Path, **jwt_fields: Any) -> Verifier:
    parsed = parse_policy(jwt_policy(idp.jwks(), tmp_path / "jwks.json", **jwt_fields))
    config = parsed.document.auth.jwt
    assert config is not None
    keys = parse_key_set(json.dumps(idp.jwks()).encode())
    return Verifier(config, parsed, keys, lambda: None)


def hostile_tokens(idp: Provider) -> dict[str, tuple[str, int]]:
    """Each hostile token, and the status it must get."""
    now = int(time.time())
    header = {"alg": "RS256", "typ": "JWT", "kid": "r1"}
    good = idp.token()
    head, body, sig = good.split(".")
    other = Provider()  # another key's signature under our kid
    forged_tier = json.loads(base64.urlsafe_b64decode(body + "=="))
    forged_tier["tier"] = "enterprise"
    return {
        "expired": (idp.token(exp=now - 3600), 401),
        "wrong audience": (idp.token(aud="someone-else"), 401),
        "wrong issuer": (idp.token(iss="https://evil.example"), 401),
        "not yet valid": (idp.token(nbf=now + 3600), 401),
        "no exp": (idp.token(exp=None), 401),
        "alg none": (_unsigned({**header, "alg": "none"}, _claims()), 401),
        "alg None, a signature": (_unsigned({**header, "alg": "None"}, _claims(), b"x"), 401),
        "HS256 signed with the public key": (
            _hs256_with(idp.public_pem(), header, _claims()),
            401,
        ),
        "HS256 signed with the JWK's modulus": (
            _hs256_with(idp.jwks()["keys"][0]["n"].encode(), header, _claims()),
            401,
        ),
        "unknown kid": (
            idp.token().replace(head, _b64(json.dumps({**header, "kid": "zz"}).encode())),
            401,
        ),
        "another key's signature": (
            jwt.encode(_claims(), other.rsa, algorithm="RS256", headers={"kid": "r1"}),
            401,
        ),
        "an EC token under the RSA kid": (
            jwt.encode(_claims(), idp.ec, algorithm="ES256", headers={"kid": "r1"}),
            401,
        ),
        "tier raised without re-signing": (
            f"{head}.{_b64(json.dumps(forged_tier).encode())}.{sig}",
            401,
        ),
        "a tier the policy lacks": (idp.token(tier="platinum"), 403),
        "no tier": (idp.token(tier=None), 403),
        "a key id with spaces": (idp.token(sub="alice smith"), 401),
        "a key id that is a number": (idp.token(sub=None, uid=7), 401),
        "an API key's id": (idp.token(sub="pai"), 403),
        "an API key's id and a line feed": (idp.token(sub="pai\n"), 401),
        "100 KB": (idp.token(pad="x" * 100_000), 401),
        "garbage": ("a.b.c", 401),
    }


def _hs256_with(secret: bytes, header: dict[str, Any], claims: dict[str, Any]) -> str:
    """The classic confusion: an HMAC whose secret is the public key."""
    import hashlib
    import hmac

    signing = ".".join(
        (
            _b64(json.dumps({**header, "alg": "HS256"}).encode()),
            _b64(json.dumps(claims).encode()),
        )
    )
    mac = hmac.new(secret, signing.encode(), hashlib.sha256).digest()
    return f"{signing}.{_b64(mac)}"


def test_a_good_token_is_its_claims(idp: Provider, tmp_path: Path) -> None:
    check = verifier(idp, tmp_path)
    for kid in ("r1", "e1"):
        key = check.identify(idp.token(kid=kid, sub=f"svc-{kid}", tier="enterprise"))
        assert (key.id, key.tier, key.admin, key.disabled) == (
            f"svc-{kid}",
            "enterprise",
            False,
            False,
        )
    key = verifier(idp, tmp_path, key_claim="email", tier_claim="plan").identify(
        idp.token(email="a@b.example", plan="free")
    )
    assert (key.id, key.tier) == ("a@b.example", "free")


@pytest.mark.parametrize("case", list(hostile_tokens(Provider())))
def test_hostile_tokens_are_refused(idp: Provider, tmp_path: Path, case: str) -> None:
    token, status = hostile_tokens(idp)[case]
    with pytest.raises(ApiError) as refused:
        verifier(idp, tmp_path).identify(token)
    assert refused.value.status == status, refused.value.message


def test_a_tier_tokens_may_not_claim(idp: Provider, tmp_path: Path) -> None:
    check = verifier(idp, tmp_path, tiers=["free", "paid"])
    assert check.identify(idp.token(tier="paid")).tier == "paid"
    with pytest.raises(ApiError) as refused:
        check.identify(idp.token(tier="enterprise"))
    assert refused.value.status == 403


def test_a_far_expiry_is_remembered_a_day_at_most(idp: Provider, tmp_path: Path) -> None:
    check = verifier(idp, tmp_path)
    assert check.identify(idp.token(exp=10**40)).id == "alice"  # (valid: its provider signed it)
    ((_, until),) = check._known.values()
    assert until <= time.time() + 86_400 + 60


def test_an_exp_that_is_a_string_of_digits(idp: Provider, tmp_path: Path) -> None:
    """PyJWT reads it as a number: a token its provider signed so is good."""
    token = idp.token(exp=str(int(time.time()) + 600))
    assert verifier(idp, tmp_path).identify(token).id == "alice"


def test_a_failed_read_waits_its_retry(idp: Provider, tmp_path: Path) -> None:
    """A source that fails is tried again after RETRY_S, not at each step;
    a new source, or a changed file, at once."""

    class Live:
        def __init__(self, policy: Any) -> None:
            self.current = policy

        def on_change(self, listener: Any) -> None:
            pass

    missing = tmp_path / "missing.json"
    text = jwt_policy({}, tmp_path / "unused.json").replace(
        str(tmp_path / "unused.json"), str(missing)
    )
    policy = parse_policy(text)
    config = policy.document.auth.jwt
    assert config is not None

    async def run() -> list[bool]:
        keys = KeySet(Live(policy))  # type: ignore[arg-type]
        seen = [keys.due(config)]
        await keys.read(config)  # fails: no file
        seen.append(keys.due(config))
        missing.write_text(json.dumps(idp.jwks()))  # the file appears
        seen.append(keys.due(config))
        await keys.read(config)
        seen.append(keys.due(config))
        return seen

    assert asyncio.run(run()) == [True, False, True, False]


def test_a_key_file_that_would_block_is_refused(tmp_path: Path, idp: Provider) -> None:
    fifo = tmp_path / "jwks.fifo"
    os.mkfifo(fifo)
    text = jwt_policy({}, tmp_path / "unused.json").replace(
        str(tmp_path / "unused.json"), str(fifo)
    )
    config = parse_policy(text).document.auth.jwt
    assert config is not None
    with pytest.raises(ValueError, match="not a regular file"):
        read_source(config)


def test_a_remembered_token_still_expires(idp: Provider, tmp_path: Path) -> None:
    check = verifier(idp, tmp_path, leeway_s=0)
    token = idp.token(exp=int(time.time()) + 2)
    assert check.identify(token).id == "alice"
    wait_for(
        lambda: time.time() > jwt.decode(token, options={"verify_signature": False})["exp"],
        5,
        "expiry",
    )
    with pytest.raises(ApiError, match="expired"):
        check.identify(token)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"algorithms": ["HS256"]}, "'HS256' is not accepted"),
        ({"algorithms": ["none"]}, "'none' is not accepted"),
        ({"jwks_url": "http://idp.example/jwks"}, "must be an https URL"),
        ({"jwks_url": "https://idp.example/jwks", "jwks_file": "/k"}, "exactly one of"),
        ({"tiers": ["gold"]}, "unknown tier 'gold'"),
        ({"leeway_s": 3600}, "leeway_s"),
        ({"refresh_s": 1}, "refresh_s"),
    ],
)
def test_a_verifier_that_could_be_fooled_is_refused(
    idp: Provider, tmp_path: Path, fields: dict[str, Any], says: str
) -> None:
    text = jwt_policy(idp.jwks(), tmp_path / "jwks.json")
    doc = json.loads(json.dumps(__import__("yaml").safe_load(text)))
    doc["auth"]["jwt"].update(fields)
    if "jwks_url" in fields and "jwks_file" not in fields:
        del doc["auth"]["jwt"]["jwks_file"]
    with pytest.raises(PolicyError, match=says):
        parse_policy(as_yaml(doc))


def test_a_key_set_keeps_only_public_signing_keys(idp: Provider) -> None:
    keys = idp.jwks()["keys"]
    private = json.loads(RSAAlgorithm.to_jwk(idp.rsa))
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    document = {
        "keys": [
            *keys,
            {"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"},  # a shared secret: never
            {**private, "kid": "private"},  # a private key: never
            {**keys[0], "kid": "enc", "use": "enc"},
            {**json.loads(RSAAlgorithm.to_jwk(weak.public_key())), "kid": "weak"},
            "nonsense",
        ]
    }
    assert sorted(parse_key_set(json.dumps(document).encode())) == ["e1", "r1"]
    with pytest.raises(ValueError, match="no public signing key"):
        parse_key_set(b'{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}')


# -- the real stack --------------------------------------------------------------


class KeyServer:
    """The provider's JWKS over HTTP on this host; counts its reads, and can go down."""

    def __init__(self, jwks: dict[str, Any]) -> None:
        self.jwks, self.reads, self.down = jwks, 0, False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.reads += 1
                if outer.down:
                    self.send_error(503)
                    return
                body = json.dumps(outer.jwks).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/jwks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def key_server(idp: Provider) -> Iterator[KeyServer]:
    server = KeyServer(idp.jwks())
    yield server
    server.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": "Bearer " + token}


def status_of_oversized(url: str, token: str) -> int:
    """The status a request whose head is over the edge's limit gets. Sent
    on a raw socket: the edge answers 431 and closes while the request is
    still arriving, so the send may fail (urllib gives up then, before
    reading the answer already sent)."""
    where = urllib.parse.urlsplit(url)
    body = b'{"input":"x"}'
    head = (
        f"POST /v1/inference HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    received = b""
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        with contextlib.suppress(OSError):  # closed by the edge while sending
            sock.sendall(head.encode() + body)
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                received += chunk
    status_line = received.split(b"\r\n", 1)[0].split()
    return int(status_line[1]) if len(status_line) > 1 else 0  # 0: reset before any answer


def test_tokens_through_the_stack(cluster_factory: Any, idp: Provider, tmp_path: Path) -> None:
    """A token's sub is its key id (its own quota, usage), its tier claim its
    tier; API keys still work; every hostile token is 401/403 over HTTP."""
    cluster = cluster_factory(jwt_policy(idp.jwks(), tmp_path / "jwks.json"))
    url = cluster.urls[0]
    status, _, body = http("POST", url + "/v1/inference", {"input": "hi"}, bearer(idp.token()))
    assert (status, body["tier"]) == (200, "paid"), body
    assert http("POST", url + "/v1/inference", {"input": "hi"}, auth("paid"))[0] == 200
    # The free tier's 2/minute is each subject's own.
    for sub in ("bob", "carol"):
        token = idp.token(sub=sub, tier="free")
        statuses = [
            http("POST", url + "/v1/inference", {"input": f"{sub} {i}"}, bearer(token))[0]
            for i in range(3)
        ]
        assert statuses == [200, 200, 429], (sub, statuses)
    for case, (token, status) in hostile_tokens(idp).items():
        if case == "100 KB":  # (over the edge's header limit: refused before it is read)
            # (a reset can still beat the answer to the client: tried again then)
            statuses = [status_of_oversized(url, token) for _ in range(5)]
            assert 431 in statuses, statuses
            assert set(statuses) <= {431, 0}, statuses
            continue
        got, _headers, body = http("POST", url + "/v1/inference", {"input": "x"}, bearer(token))
        assert got == status, (case, got, body)
        assert body["error"]["code"] in ("UNAUTHENTICATED", "FORBIDDEN"), (case, body)
    usage = http("GET", url + "/v1/admin/usage", headers=auth("admin"))[2]
    used = {row["key_id"]: row["requests"] for row in usage["keys"]}
    assert {sub: used.get(sub) for sub in ("alice", "bob", "carol")} == {
        "alice": 1,
        "bob": 2,
        "carol": 2,
    }, used
    assert cluster.status()["redis_ok"]


def test_rotation_is_read_at_most_once_a_minute_and_an_outage_keeps_the_keys(
    cluster_factory: Any, idp: Provider, key_server: KeyServer, tmp_path: Path
) -> None:
    cluster = cluster_factory(jwt_policy({}, tmp_path / "unused.json", jwks_url=key_server.url))
    url = cluster.urls[0]

    def infer(token: str) -> int:
        return http("POST", url + "/v1/inference", {"input": "x"}, bearer(token))[0]

    assert infer(idp.token()) == 200
    reads = key_server.reads
    # The provider rotates in a new key: the first token signed with it is
    # refused and asks for a read; once read, its tokens pass.
    newcomer = ec.generate_private_key(ec.SECP256R1())
    idp.kids["e2"] = newcomer
    key_server.jwks = idp.jwks()
    assert infer(idp.token(kid="e2")) == 401
    wait_for(lambda: infer(idp.token(kid="e2")) == 200, 10, "the rotated key to be read")
    assert key_server.reads == reads + 1
    # Made-up key ids within the minute: refused, and no read each.
    for i in range(20):
        token = jwt.encode(_claims(), newcomer, algorithm="ES256", headers={"kid": f"made-up-{i}"})
        assert infer(token) == 401
    assert key_server.reads == reads + 1
    # The provider goes down: the keys already read keep verifying.
    key_server.down = True
    assert infer(idp.token(kid="r1")) == 200
    assert infer(idp.token(kid="e2")) == 200
    del idp.kids["e2"]


def test_a_changed_key_file_is_read_at_once(
    cluster_factory: Any, idp: Provider, tmp_path: Path
) -> None:
    """An operator's edit of the key file takes effect within a second or so
    (a key added, a leaked key removed), whatever refresh_s says."""
    path = tmp_path / "jwks.json"
    cluster = cluster_factory(jwt_policy(idp.jwks(), path))
    url = cluster.urls[0]

    def infer(token: str) -> int:
        return http("POST", url + "/v1/inference", {"input": "x"}, bearer(token))[0]

    old_token = idp.token(kid="r1")
    assert infer(old_token) == 200
    newcomer = Provider()
    newcomer.kids = {"r9": newcomer.rsa}
    # An unknown kid spends the read it may ask for (the next is a minute away).
    assert infer(newcomer.token(kid="r9")) == 401
    # The file now holds the newcomer's key and not r1 (leaked, say).
    new_set = {"keys": [*newcomer.jwks()["keys"], idp.jwks()["keys"][1]]}
    tmp = tmp_path / "jwks.tmp"
    tmp.write_text(json.dumps(new_set))
    tmp.replace(path)
    wait_for(lambda: infer(newcomer.token(kid="r9")) == 200, 10, "the new key to be read")
    assert infer(old_token) == 401  # (remembered no longer: its key is gone)
    assert infer(idp.token(kid="e1")) == 200


def test_an_api_key_is_not_shadowed_by_the_verifier(
    cluster_factory: Any, idp: Provider, tmp_path: Path
) -> None:
    cluster = cluster_factory(jwt_policy(idp.jwks(), tmp_path / "jwks.json"))
    url = cluster.urls[0]
    assert http("GET", url + "/v1/models", headers=auth("free"))[0] == 200
    assert http("GET", url + "/v1/models", headers=auth("disabled"))[0] == 403
    # An admin route takes no token (a token is never an admin).
    assert http("GET", url + "/v1/status", headers=bearer(idp.token(tier="enterprise")))[0] == 403
    assert SECRETS["admin"]
    assert http("GET", url + "/v1/status", headers=auth("admin"))[0] == 200
