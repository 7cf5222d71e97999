"""The identity provider's public keys (its JWKS), for the live policy's
``auth.jwt``: read at start, every ``refresh_s``, and soon after a token
names a key the set lacks (at most once a minute: a stream of made-up key ids
costs one read a minute). Always off the request path, from a file or a URL,
and the last good set is kept while the source is down or serves nonsense.
"""

import asyncio
import contextlib
import json
import os
import stat
import time
import urllib.request
from typing import Any

from infergate.base import logs
from infergate.base.loops import Supervised
from infergate.gateway.tokens import SigningKey, Verifier
from infergate.policies import Policy
from infergate.policies.auth import trusted_url
from infergate.policies.live import LivePolicy
from infergate.policies.schema import Jwt

log = logs.get(__name__)

MAX_JWKS_BYTES = 1 << 20
FETCH_TIMEOUT_S = 5.0
# Reads asked for by unknown key ids, at most one per this long.
WANTED_EVERY_S = 60.0
# After a failed read, the next try.
RETRY_S = 30.0

Source = tuple[str | None, str | None]
NO_KEYS: dict[str, SigningKey] = {}  # (before the policy's source is read)


def read_source(config: Jwt) -> bytes:
    """The key set's bytes from its file or URL (blocking: run in a thread)."""
    if config.jwks_file is not None:
        data = _read_file(config.jwks_file)
    else:
        assert config.jwks_url is not None
        data = _fetch(config.jwks_url)
    if len(data) > MAX_JWKS_BYTES:
        raise ValueError(f"the key set is over {MAX_JWKS_BYTES} bytes")
    return data


def _read_file(path: str) -> bytes:
    """A regular file's first MAX_JWKS_BYTES + 1 bytes (a FIFO or a device
    would block or never end: refused, never waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("the key set file is not a regular file")
        return f.read(MAX_JWKS_BYTES + 1)


class _TrustedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL the policy would accept (never from
    https down to plain http)."""

    def redirect_request(
        self, req: Any, fp: Any, code: Any, msg: Any, headers: Any, newurl: str
    ) -> Any:
        if not trusted_url(newurl):
            raise ValueError("the key set's URL redirects to a URL that is not https")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_opener = urllib.request.build_opener(_TrustedRedirects)


def _fetch(url: str) -> bytes:
    """At most MAX_JWKS_BYTES + 1 bytes, within FETCH_TIMEOUT_S in all (a
    server that drips its answer is cut off)."""
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    chunks: list[bytes] = []
    size = 0
    with _opener.open(request, timeout=FETCH_TIMEOUT_S) as response:
        while size <= MAX_JWKS_BYTES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the key set took over {FETCH_TIMEOUT_S} s to read")
            chunk = response.read(65_536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks)


def parse_key_set(data: bytes) -> dict[str, SigningKey]:
    """The public keys of a JWKS document, by kid; keys that are not
    public signing keys are left out (and said)."""
    doc: Any = json.loads(data)
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise ValueError('not a JWKS document ({"keys": [...]})')
    keys: dict[str, SigningKey] = {}
    for i, jwk in enumerate(doc["keys"]):
        if not isinstance(jwk, dict) or jwk.get("use", "sig") != "sig":
            continue
        try:
            key = SigningKey(jwk)
        except Exception as exc:  # (PyJWT and cryptography raise several kinds)
            log.warning("jwks.key_skipped", index=i, error=f"{type(exc).__name__}: {exc}"[:200])
            continue
        keys[key.kid] = key
    if not keys:
        raise ValueError("the key set holds no public signing key")
    return keys


class KeySet:
    """The keys of the live policy's identity provider, and the verifier
    that uses them."""

    def __init__(self, policy: LivePolicy) -> None:
        self.policy = policy
        self._source: Source | None = None  # (of the keys held)
        self._tried: Source | None = None  # (of the last read, good or not)
        self._keys: dict[str, SigningKey] = {}
        self._verifier: Verifier | None = None
        self._next_read_s = 0.0
        self._wanted_at_s = -WANTED_EVERY_S
        self._asked_at_s = -WANTED_EVERY_S
        self._wake = asyncio.Event()
        # The file's identity and size when it was last read (a change is read at once).
        self._stamp: tuple[int, int, int] | None = None
        self.loop = Supervised("jwks", self._step, 0)
        policy.on_change(self._policy_changed)

    def _policy_changed(self, policy: Policy) -> None:
        """An operator changed the policy: read the key set again now (how a
        removed key is cut off at once, whatever refresh_s says)."""
        self._ask()

    def verifier(self, policy: Policy) -> Verifier | None:
        """The verifier for ``policy`` (None: it takes no tokens), made
        again when the policy or the keys change."""
        config = policy.document.auth.jwt
        if config is None:
            return None
        keys = self._keys if self._source == _source_of(config) else NO_KEYS
        verifier = self._verifier
        if verifier is None or verifier.policy is not policy or verifier.keys is not keys:
            verifier = self._verifier = Verifier(config, policy, keys, self.want)
        return verifier

    def want(self) -> None:
        """A token named a key the set lacks: read it again, unless that
        was asked less than a minute ago."""
        now = time.monotonic()
        if now - self._wanted_at_s >= WANTED_EVERY_S:
            self._wanted_at_s = now
            self._ask()

    def _ask(self) -> None:
        """Read the set at the next step (and again after a read that
        this ask came in the middle of)."""
        self._asked_at_s = time.monotonic()
        self._next_read_s = 0.0
        self._wake.set()

    async def start(self) -> None:
        """Read the set once before serving (a failure is logged: tokens
        are refused until a read succeeds), then keep it."""
        config = self.policy.current.document.auth.jwt
        if config is not None:
            await self.read(config)
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()

    async def _step(self) -> None:
        config = self.policy.current.document.auth.jwt
        self._wake.clear()  # (a want from here on wakes the next step)
        if config is not None and self.due(config):
            await self.read(config)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), 1.0)

    def due(self, config: Jwt) -> bool:
        """Whether to read the set now: a new source, its time (a refresh, a
        retry, an ask), or its file changed."""
        if _source_of(config) != self._tried or time.monotonic() >= self._next_read_s:
            return True
        return config.jwks_file is not None and _stamp(config.jwks_file) != self._stamp

    async def read(self, config: Jwt) -> None:
        source = self._tried = _source_of(config)
        started = time.monotonic()
        if config.jwks_file is not None:
            self._stamp = _stamp(config.jwks_file)
        try:
            keys = parse_key_set(await asyncio.to_thread(read_source, config))
        except Exception as exc:
            self._next_read_s = time.monotonic() + min(RETRY_S, config.refresh_s)
            log.warning(
                "jwks.read_failed",
                source=config.jwks_file or config.jwks_url,
                kept=len(self._keys) if source == self._source else 0,
                error=f"{type(exc).__name__}: {exc}"[:300],
            )
            return
        # What was asked for while this read ran may be newer than what it read.
        asked_since = self._asked_at_s >= started
        self._next_read_s = 0.0 if asked_since else time.monotonic() + config.refresh_s
        if source != self._source or _fingerprint(keys) != _fingerprint(self._keys):
            self._source, self._keys = source, keys
            log.info("jwks.read", source=config.jwks_file or config.jwks_url, kids=sorted(keys))


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What says a file changed: its inode, size and modification time."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _source_of(config: Jwt) -> Source:
    return (config.jwks_file, config.jwks_url)


def _fingerprint(keys: dict[str, SigningKey]) -> dict[str, object]:
    return {kid: (key.kty, key.crv, key.alg, _public_numbers(key)) for kid, key in keys.items()}


def _public_numbers(key: SigningKey) -> object:
    numbers = getattr(key.key, "public_numbers", None)
    if numbers is not None:
        return numbers()
    return getattr(key.key, "public_bytes_raw", lambda: None)()
