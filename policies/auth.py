"""What the policy's ``auth`` and ``openai`` sections must mean: a JWT
verifier that can only accept what its identity provider signed (asymmetric
algorithms, an issuer and an audience, one source of keys), and a chat
template that names what it renders."""

from urllib.parse import urlsplit

from infergate.policies.errors import Problem
from infergate.policies.locator import Locator
from infergate.policies.schema import Document, Jwt

# What a token may be signed with: public-key algorithms only. "none" and the
# HMACs are never accepted (an HMAC "verified" with a public key is a forgery
# anyone can make).
ASYMMETRIC = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA",
)  # fmt: skip
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_clients(doc: Document, at: Locator) -> list[Problem]:
    """The sections that say how clients come in: ``auth`` and ``openai``."""
    return [*_check_jwt(doc, at), *_check_openai(doc, at)]


def _check_jwt(doc: Document, at: Locator) -> list[Problem]:
    jwt = doc.auth.jwt
    if jwt is None:
        return []
    here: list[str | int] = ["auth", "jwt"]
    out = [*_check_source(jwt, here, at), *_check_claims(doc, jwt, here, at)]
    if not jwt.issuer:
        out.append(at.problem([*here, "issuer"], "must name the token issuer (its iss claim)"))
    audiences = [jwt.audience] if isinstance(jwt.audience, str) else jwt.audience
    if not audiences or not all(audiences):
        out.append(at.problem([*here, "audience"], "must name this API (the tokens' aud claim)"))
    if not jwt.algorithms:
        out.append(at.problem([*here, "algorithms"], "list at least one, e.g. [RS256, ES256]"))
    for i, alg in enumerate(jwt.algorithms):
        if alg not in ASYMMETRIC:
            out.append(
                at.problem(
                    [*here, "algorithms", i],
                    f"{alg!r} is not accepted; use public-key algorithms: {', '.join(ASYMMETRIC)}",
                )
            )
    if not 0 <= jwt.leeway_s <= 300:
        out.append(at.problem([*here, "leeway_s"], "must be 0-300 seconds, e.g. 30"))
    if not 60 <= jwt.refresh_s <= 86_400:
        out.append(at.problem([*here, "refresh_s"], "must be 60-86400 seconds, e.g. 300"))
    return out


def _check_source(jwt: Jwt, here: list[str | int], at: Locator) -> list[Problem]:
    if (jwt.jwks_file is None) == (jwt.jwks_url is None):
        return [at.problem(here, "give exactly one of jwks_file and jwks_url")]
    if jwt.jwks_url is None or trusted_url(jwt.jwks_url):
        return []
    return [
        at.problem(
            [*here, "jwks_url"],
            "must be an https URL (plain http only on this host: keys read over plain "
            "http could be anyone's)",
        )
    ]


def trusted_url(text: str) -> bool:
    """A URL keys may be read from: https, or plain http on this host."""
    url = urlsplit(text)
    if url.scheme == "https" and url.hostname:
        return True
    return url.scheme == "http" and url.hostname in LOOPBACK


def _check_claims(doc: Document, jwt: Jwt, here: list[str | int], at: Locator) -> list[Problem]:
    out = []
    for field in ("key_claim", "tier_claim"):
        if not getattr(jwt, field):
            out.append(at.problem([*here, field], "must name a claim"))
    for i, tier in enumerate(jwt.tiers):
        if tier not in doc.tiers:
            out.append(
                at.problem(
                    [*here, "tiers", i],
                    f"unknown tier {tier!r}; write one of {', '.join(doc.tiers)}",
                )
            )
    return out


def _check_openai(doc: Document, at: Locator) -> list[Problem]:
    template = doc.openai.chat_template
    if template is None or "{content}" in template.message:
        return []
    return [
        at.problem(
            ["openai", "chat_template", "message"],
            "must contain {content} (and may contain {role}), e.g. '{role}: {content}\\n'",
        )
    ]
