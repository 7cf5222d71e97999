"""The built-in demo policy of ``infergate up``: ``example.yaml`` with one
fresh key per tier in place of its example keys."""

import secrets
from importlib import resources

from infergate.base.tiers import TIERS
from infergate.policies.loader import digest

# The tier whose demo key is also the admin key.
ADMIN_TIER = "enterprise"


def example_text() -> str:
    return resources.files("infergate.policies").joinpath("example.yaml").read_text("utf-8")


def new_secret(tier: str) -> str:
    return f"ig-{tier[:3]}-{secrets.token_urlsafe(24)}"


def demo_policy(text: str | None = None) -> tuple[str, dict[str, str]]:
    """Returns (YAML text, {tier: secret key}): ``text`` (default: the
    example's) with one fresh key per tier in place of its keys, or after it
    when it has none."""
    text = example_text() if text is None else text
    keys = {tier: new_secret(tier) for tier in TIERS}
    entries = "".join(
        f"  - id: demo-{tier}\n    tier: {tier}\n    sha256: {digest(secret)}\n"
        + ("    admin: true\n" if tier == ADMIN_TIER else "")
        for tier, secret in keys.items()
    )
    block = (
        "# Demo keys, made fresh by `infergate up` (printed once at start).\nkeys:\n"
        + entries
        + "\n"
    )
    if "\nkeys:\n" not in text:
        return text.rstrip("\n") + "\n\n" + block, keys
    start = text.index("\nkeys:\n") + 1
    end = text.index("\nbatching:", start) + 1
    return text[:start] + block + text[end:], keys
