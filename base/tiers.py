"""The tier names, in priority order, and the process roles."""

from typing import Final

# Priority order: a batch is filled from the first tier first.
TIERS: Final = ("enterprise", "paid", "free")

ROLES: Final = ("gateway", "dispatcher", "worker")
