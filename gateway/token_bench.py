"""What a JWT costs the gateway: one seen for the first time (its header
read, its signature checked, its claims read: RS256 and ES256) and one seen
before (remembered until it expires). Keys are made in memory.

    python -m infergate.gateway.token_bench [--tokens 2000]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from infergate.gateway.jwks import parse_key_set
from infergate.gateway.tokens import Verifier
from infergate.policies import parse_policy
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

POLICY = """
tiers:
  enterprise: {deadline_ms: 10000, max_input_chars: 4000, latency_budget_ms: 2000}
  paid: {deadline_ms: 10000, max_input_chars: 2000, latency_budget_ms: 2000}
  free: {deadline_ms: 10000, max_input_chars: 1000, latency_budget_ms: 2000}
auth:
  jwt: {issuer: "https://idp.example", audience: infergate, jwks_file: JWKS}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.gateway.token_bench")
    p.add_argument("--tokens", type=int, default=2000, help="distinct tokens per algorithm")
    args = p.parse_args(argv)
    keys: dict[str, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey] = {
        "RS256": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "ES256": ec.generate_private_key(ec.SECP256R1()),
    }
    jwks: dict[str, list[dict[str, Any]]] = {"keys": []}
    for alg, key in keys.items():
        public = key.public_key()
        jwk = (
            RSAAlgorithm.to_jwk(public)
            if isinstance(public, rsa.RSAPublicKey)
            else ECAlgorithm.to_jwk(public)
        )
        jwks["keys"].append({**json.loads(jwk), "kid": alg})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "jwks.json"
        path.write_text(json.dumps(jwks))
        policy = parse_policy(POLICY.replace("JWKS", str(path)))
    config = policy.document.auth.jwt
    assert config is not None
    verifier = Verifier(config, policy, parse_key_set(json.dumps(jwks).encode()), lambda: None)
    exp = int(time.time()) + 3600
    for alg, key in keys.items():
        tokens = [
            jwt.encode(
                {"iss": config.issuer, "aud": "infergate", "sub": f"user-{i}", "tier": "paid",
                 "exp": exp},
                key,
                algorithm=alg,
                headers={"kid": alg},
            )
            for i in range(args.tokens)
        ]  # fmt: skip
        started = time.perf_counter()
        for token in tokens:
            verifier.identify(token)
        first = (time.perf_counter() - started) / len(tokens) * 1e6
        started = time.perf_counter()
        for _ in range(10):
            for token in tokens:
                verifier.identify(token)
        again = (time.perf_counter() - started) / (10 * len(tokens)) * 1e6
        print(
            f"{alg}: {first:.1f} us a token seen first (signature checked), "
            f"{again:.2f} us a token seen before ({len(tokens)} tokens)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
