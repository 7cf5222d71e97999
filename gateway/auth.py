"""Who is calling: the one Authorization header's Bearer credential, an API
key of the policy or (with ``auth.jwt``) a JWT its identity provider signed.

An API key is matched by its SHA-256 (a secret matched once is remembered,
no hash per request); a token by ``tokens.Verifier``. Either way the caller
is a ``KeyEntry``: its id is the account of its quotas, usage and fair share,
its tier the tier. A token is never an admin and never disabled here (its
provider stops issuing it).
"""

from infergate.gateway.errors import ApiError
from infergate.gateway.jwks import KeySet
from infergate.gateway.tokens import looks_like_jwt
from infergate.policies import KeyEntry, Policy
from infergate.policies.loader import digest

KNOWN_KEYS_MAX = 10_000

# What a request's credentials are when it sent several Authorization
# headers: refused, whichever endpoint reads them (a value of one header
# can never be this string: the HTTP parser refuses a line feed in it).
SEVERAL_AUTHORIZATIONS = "\n"


def one_authorization(values: list[str]) -> str | None:
    """The request's one Authorization header (None if it sent none)."""
    if len(values) > 1:
        return SEVERAL_AUTHORIZATIONS
    return values[0] if values else None


class Authenticator:
    def __init__(self, key_set: KeySet) -> None:
        self.key_set = key_set
        # Secrets already matched to a key of the active policy (``_key_of``).
        self._keys_policy: Policy | None = None
        self._keys_known: dict[str, KeyEntry] = {}

    def authenticate(self, authorization: str | None, policy: Policy) -> KeyEntry:
        if authorization is SEVERAL_AUTHORIZATIONS:
            raise ApiError(
                "UNAUTHENTICATED", "more than one Authorization header; send exactly one"
            )
        if not authorization:
            raise ApiError("UNAUTHENTICATED", "missing API key; send 'Authorization: Bearer <key>'")
        scheme, _, secret = authorization.strip().partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise ApiError(
                "UNAUTHENTICATED",
                "malformed Authorization header; send 'Authorization: Bearer <key>'",
            )
        key = self._key_of(secret, policy)
        if key is None:
            verifier = self.key_set.verifier(policy)
            if verifier is not None and looks_like_jwt(secret):
                return verifier.identify(secret)
            raise ApiError("UNAUTHENTICATED", "unknown API key")
        if key.disabled:
            raise ApiError("KEY_DISABLED", "this API key is disabled")
        return key

    def _key_of(self, secret: str, policy: Policy) -> KeyEntry | None:
        """The policy's key for ``secret``. A secret already matched is
        remembered (no SHA-256 per request): only secrets of the policy's own
        keys, so the memory is as bounded as the policy; a new policy
        forgets them all."""
        if policy is not self._keys_policy:
            self._keys_policy, self._keys_known = policy, {}
        key = self._keys_known.get(secret)
        if key is None:
            key = policy.key_for_digest(digest(secret))
            if key is not None and len(self._keys_known) < KNOWN_KEYS_MAX:
                self._keys_known[secret] = key
        return key
