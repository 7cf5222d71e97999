"""The YAML policy: tiers, keys, limits, batching and capacity settings.

``load_policy(path)`` parses and validates a file and returns an immutable
``Policy``; every problem is reported as ``FILE:LINE: path: what is wrong``.
"""

from infergate.policies.errors import PolicyError, Problem
from infergate.policies.loader import load_policy, parse_policy
from infergate.policies.schema import Batching, Budget, Capacity, KeyEntry, Policy, Tier

__all__ = [
    "Batching",
    "Budget",
    "Capacity",
    "KeyEntry",
    "Policy",
    "PolicyError",
    "Problem",
    "Tier",
    "load_policy",
    "parse_policy",
]
