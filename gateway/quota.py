"""Per-key quotas with the ``limits`` library, on the deployment's Redis
through redis-py (the same connection pool as everything else), so every
gateway process shares one count.

Each limit is a ``limits`` fixed window (``item.key_for`` / ``storage.incr``,
as ``FixedWindowRateLimiter.hit`` does). A request is charged to all of its
limits at once (one concurrent round trip); if any refuses, every charge of
that request is refunded, so a refused request consumes no limit and the
counters hold exactly what was admitted. Counters only ever over-count for
the instant before a refund, so racing gateways never admit more than the
quota.
"""

import asyncio
import math
import time
from dataclasses import dataclass
from functools import lru_cache

from infergate.policies import KeyEntry, Tier
from limits import RateLimitItem, parse_many
from limits.aio.storage import RedisStorage


@lru_cache(maxsize=1024)
def parse_rates(rates: tuple[str, ...]) -> tuple[RateLimitItem, ...]:
    return tuple(item for rate in rates for item in parse_many(rate))


@dataclass(frozen=True)
class Charge:
    item: RateLimitItem
    key: str
    cost: int
    kind: str  # "requests" or "cost"


@dataclass(frozen=True)
class QuotaResult:
    allowed: bool
    # The request limit closest to running out (for the x-ratelimit-* headers).
    limit: int | None = None
    remaining: int | None = None
    reset_s: float | None = None
    # When refused: which limit, and how long until its window resets.
    refused_by: str | None = None
    retry_after_ms: int | None = None

    def headers(self) -> dict[str, str]:
        if self.limit is None or self.remaining is None or self.reset_s is None:
            return {}
        return {
            "x-ratelimit-limit-requests": str(self.limit),
            "x-ratelimit-remaining-requests": str(self.remaining),
            "x-ratelimit-reset-requests": f"{self.reset_s:.3f}s",
        }


class Quota:
    def __init__(self, storage: RedisStorage) -> None:
        self.storage = storage
        # When each window ends (epoch s), learned when this gateway opens a
        # window or from one TTL read per window: no extra round trip per request.
        self._window_end: dict[str, float] = {}

    def charges(self, key: KeyEntry, tier: Tier, input_chars: int) -> list[Charge]:
        rates = key.rate_limits if key.rate_limits is not None else tier.rate_limits
        out = [
            Charge(item, item.key_for(key.id, "requests"), 1, "requests")
            for item in parse_rates(tuple(rates))
        ]
        if tier.cost_limit:
            out += [
                Charge(item, item.key_for(key.id, "chars"), input_chars, "cost")
                for item in parse_rates((tier.cost_limit,))
            ]
        return out

    async def charge(self, key: KeyEntry, tier: Tier, input_chars: int) -> QuotaResult:
        charges = self.charges(key, tier, input_chars)
        if not charges:
            return QuotaResult(True)
        counts = await asyncio.gather(
            *(self.storage.incr(c.key, c.item.get_expiry(), amount=c.cost) for c in charges)
        )
        now = time.time()
        for c, n in zip(charges, counts, strict=True):
            if n == c.cost:  # this request opened the window
                self._window_end[c.key] = now + c.item.get_expiry()
        refused = [c for c, n in zip(charges, counts, strict=True) if n > c.item.amount]
        if refused:
            await asyncio.gather(
                *(self.storage.incr(c.key, c.item.get_expiry(), amount=-c.cost) for c in charges)
            )
        # The request limit closest to running out names the x-ratelimit-* headers.
        requests = [(c, n) for c, n in zip(charges, counts, strict=True) if c.kind == "requests"]
        limit = remaining = None
        reset_s = None
        if requests:
            charge, count = min(requests, key=lambda cn: cn[0].item.amount - cn[1])
            used = count - charge.cost if refused else count
            limit, remaining = charge.item.amount, max(0, charge.item.amount - used)
            reset_s = await self._reset_s(charge)
        if not refused:
            return QuotaResult(True, limit, remaining, reset_s)
        worst = refused[0]
        retry_s = await self._reset_s(worst)
        what = "input characters" if worst.kind == "cost" else "requests"
        return QuotaResult(
            False,
            limit,
            remaining,
            reset_s,
            refused_by=f"{worst.item} ({what})",
            retry_after_ms=max(1, math.ceil(retry_s * 1000)),
        )

    async def refund(self, key: KeyEntry, tier: Tier, input_chars: int) -> None:
        """Give back what ``charge`` took for a request refused after it (a job
        over its key's queued bound)."""
        charges = self.charges(key, tier, input_chars)
        await asyncio.gather(
            *(self.storage.incr(c.key, c.item.get_expiry(), amount=-c.cost) for c in charges)
        )

    async def _reset_s(self, charge: Charge) -> float:
        now = time.time()
        end = self._window_end.get(charge.key, 0.0)
        if end <= now:
            if len(self._window_end) > 100_000:
                self._window_end = {k: v for k, v in self._window_end.items() if v > now}
            end = await self.storage.get_expiry(charge.key)
            self._window_end[charge.key] = end
        return max(0.0, end - now)
