"""Bearer tokens that are JWTs (policy ``auth.jwt``): who signed them, for
whom, until when, and which key id and tier they name.

A token is verified against the identity provider's public keys (``Jwks``,
read off the request path) by PyJWT, with its algorithm pinned twice: it must
be one the policy lists (public-key algorithms only) and the one its signing
key is for. So ``alg: none`` and an HMAC "signed" with a public key are
refused before any signature is computed. A token verified once is
remembered until it expires (or the key set or policy changes): a client that
sends the same token on every request pays one signature check.
"""

import re
import time
from collections.abc import Callable
from typing import Any

import jwt
from infergate.base import logs
from infergate.gateway.errors import ApiError
from infergate.policies import KeyEntry, Policy
from infergate.policies.schema import Jwt

log = logs.get(__name__)

# Longer is no token an identity provider issues: refused unread.
MAX_TOKEN_CHARS = 16_384
# A key id from a token: printable ASCII, no spaces (it names Redis fields and
# appears in usage reports), at most this long.
TOKEN_KEY_ID = re.compile(r"^[!-~]{1,128}\Z")
# Tokens remembered as verified, at most (then forgotten all at once), and
# for at most this long.
KNOWN_TOKENS_MAX = 10_000
REMEMBERED_AT_MOST_S = 86_400
# The smallest RSA key that signs anything here.
MIN_RSA_BITS = 2048
# The JWT's compact form: three base64url segments.
_COMPACT = re.compile(r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*\Z")

# The algorithms a key of each type signs with (a key that names its own
# ``alg`` signs with that one only).
_FAMILY = {
    "RSA": ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512"),
    "EC": ("ES256", "ES384", "ES512"),
    "OKP": ("EdDSA",),
}
_CURVE = {"ES256": "P-256", "ES384": "P-384", "ES512": "P-521"}


def looks_like_jwt(secret: str) -> bool:
    return secret.count(".") == 2 and _COMPACT.match(secret) is not None


def unauthenticated(why: str) -> ApiError:
    return ApiError("UNAUTHENTICATED", f"invalid token: {why}")


class SigningKey:
    """One public key of the set: its key id, type and curve, the
    algorithm it names (if any), and the key itself."""

    def __init__(self, jwk: dict[str, Any]) -> None:
        self.kid = str(jwk.get("kid", ""))
        self.kty = str(jwk.get("kty", ""))
        self.crv = str(jwk.get("crv", ""))
        self.alg = jwk.get("alg")
        if self.kty not in _FAMILY:
            raise ValueError(f"key type {self.kty!r} is not a public-key type")
        if "d" in jwk:
            raise ValueError("a private key does not belong in a key set")
        self.key = jwt.PyJWK(jwk).key
        bits = getattr(self.key, "key_size", MIN_RSA_BITS)
        if self.kty == "RSA" and bits < MIN_RSA_BITS:
            raise ValueError(f"an RSA key of {bits} bits is too weak (at least {MIN_RSA_BITS})")

    def signs_with(self, alg: str) -> bool:
        if self.alg is not None:
            return bool(alg == self.alg)
        if alg not in _FAMILY[self.kty]:
            return False
        return self.kty != "EC" or _CURVE.get(alg) == self.crv


class Verifier:
    """Verifies tokens under one policy's ``auth.jwt`` and one key set."""

    def __init__(
        self,
        config: Jwt,
        policy: Policy,
        keys: dict[str, SigningKey],
        want_keys: Callable[[], None],
    ) -> None:
        self.config = config
        self.policy = policy
        self.keys = keys
        # Asks for the key set to be read again (a kid it lacks).
        self.want_keys = want_keys
        self._known: dict[str, tuple[KeyEntry, float]] = {}
        self._entries: dict[tuple[str, str], KeyEntry] = {}
        # A token never stands for an API key's account (its quotas, jobs, models).
        self._api_key_ids = frozenset(key.id for key in policy.document.keys)

    def identify(self, token: str) -> KeyEntry:
        """The key a token stands for, or 401 (not a token this gateway
        trusts) or 403 (a tier it may not claim)."""
        known = self._known.get(token)
        if known is not None:
            entry, expires = known
            if time.time() < expires:
                return entry
            del self._known[token]
        claims = self._verified(token)
        entry = self._entry(claims)
        if len(self._known) >= KNOWN_TOKENS_MAX:
            self._known.clear()
        # (exp is what PyJWT read as an integer: a number, or a string of
        # one; a huge one is remembered a day)
        until = min(int(claims["exp"]), int(time.time()) + REMEMBERED_AT_MOST_S)
        self._known[token] = (entry, until + self.config.leeway_s)
        return entry

    def _verified(self, token: str) -> dict[str, Any]:
        if len(token) > MAX_TOKEN_CHARS:
            raise unauthenticated(f"longer than {MAX_TOKEN_CHARS} characters")
        try:
            header = jwt.get_unverified_header(token)
        except (jwt.PyJWTError, ValueError, TypeError, RecursionError):
            raise unauthenticated("not a well-formed JWT") from None
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str) or alg not in self.config.algorithms:
            raise unauthenticated(
                f"algorithm {str(alg)[:20]!r} not accepted (only {', '.join(self.config.algorithms)})"
            )
        key = self._key(kid)
        if not key.signs_with(alg):
            raise unauthenticated(f"its key {key.kid!r} does not sign with {alg}")
        config = self.config
        try:
            return jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=config.audience,
                issuer=config.issuer,
                leeway=config.leeway_s,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise unauthenticated("expired") from None
        except jwt.ImmatureSignatureError:
            raise unauthenticated("not valid yet (nbf or iat)") from None
        except jwt.InvalidAudienceError:
            raise unauthenticated("not for this audience") from None
        except jwt.InvalidIssuerError:
            raise unauthenticated("not from the trusted issuer") from None
        except jwt.MissingRequiredClaimError as exc:
            raise unauthenticated(f"no {exc.claim} claim") from None
        except jwt.InvalidSignatureError:
            raise unauthenticated("bad signature") from None
        except jwt.PyJWTError as exc:
            raise unauthenticated(type(exc).__name__) from None
        except (ValueError, TypeError, OverflowError, RecursionError):
            raise unauthenticated("not a well-formed JWT") from None

    def _key(self, kid: object) -> SigningKey:
        if kid is None and len(self.keys) == 1:
            return next(iter(self.keys.values()))
        key = self.keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            self.want_keys()  # (a rotation: read the set again, at most once a minute)
            raise unauthenticated(f"unknown signing key (kid {str(kid)[:64]!r})")
        return key

    def _entry(self, claims: dict[str, Any]) -> KeyEntry:
        """The token's key: its key claim is the id, its tier claim the tier."""
        config, policy = self.config, self.policy
        key_id = claims.get(config.key_claim)
        if not isinstance(key_id, str) or not TOKEN_KEY_ID.match(key_id):
            raise unauthenticated(
                f"its {config.key_claim!r} claim is not a key id "
                "(1-128 printable ASCII characters, no spaces)"
            )
        if key_id in self._api_key_ids:
            raise ApiError(
                "FORBIDDEN", "the token names an API key's id; a token has an account of its own"
            )
        tier = claims.get(config.tier_claim)
        if not isinstance(tier, str) or tier not in policy.tiers:
            raise ApiError(
                "FORBIDDEN",
                f"the token's {config.tier_claim!r} claim names no tier of this gateway "
                f"({', '.join(policy.tiers)})",
            )
        if config.tiers and tier not in config.tiers:
            raise ApiError("FORBIDDEN", f"tokens may not claim the {tier} tier here")
        entry = self._entries.get((key_id, tier))
        if entry is None:
            entry = KeyEntry(id=key_id, tier=tier, sha256="")
            if len(self._entries) < KNOWN_TOKENS_MAX:
                self._entries[(key_id, tier)] = entry
        return entry
