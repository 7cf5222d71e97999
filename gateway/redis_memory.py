"""Backpressure before Redis is full: a gateway reads each shard's memory
once a second, off the request path, and past the policy's high-water mark
of ``maxmemory`` refuses new work, the lowest tier first: free at the mark,
paid a third of the way from it to full, enterprise two thirds, so the
paying tiers keep room while the free one backs off. Redis's own refusal
(out of memory) stays the last guard. A Redis with no maxmemory or one that
evicts, or an ACL that denies INFO, has no mark (the last said once in the
log); nor has a shard whose memory cannot be read now."""

import math
from collections.abc import Callable, Sequence

from infergate.base import logs
from infergate.base.loops import Supervised
from infergate.base.queue.store import Store
from infergate.base.tiers import TIERS
from prometheus_client import Gauge
from redis.exceptions import ResponseError

log = logs.get(__name__)

READ_EVERY_S = 1.0
# ... and this often while a shard is past the mark: a tier refused is
# served again soon after memory frees, and the next tier's mark is seen soon.
READ_PAST_MARK_S = 0.2


def tier_mark(tier: str, high_water: float) -> float:
    """The use of maxmemory from which ``tier``'s new work is refused
    (above 1, never: a mark of 1 leaves it to Redis's own refusal)."""
    if high_water >= 1.0:
        return math.inf
    rank = len(TIERS) - 1 - TIERS.index(tier)  # free 0, paid 1, enterprise 2
    return high_water + (1.0 - high_water) * rank / len(TIERS)


class RedisMemory:
    def __init__(
        self,
        stores: Sequence[Store],
        high_water: Callable[[], float],
        gauge: Gauge,
        mark_gauge: Gauge,
    ) -> None:
        """``high_water()`` is the policy's mark now; ``gauge`` shows the
        highest use among the shards, ``mark_gauge`` the mark."""
        self._stores = stores
        self._high_water = high_water
        self.use = [0.0] * len(stores)  # 0: no maxmemory, or not read
        self._unreadable: set[int] = set()
        gauge.set_function(lambda: max(self.use, default=0.0))
        mark_gauge.set_function(high_water)
        self.loop = Supervised("redis-memory", self.read, READ_EVERY_S)

    def refuses(self, shard: int, tier: str) -> float | None:
        """The use that refuses ``tier``'s new work on ``shard``, if it does."""
        use = self.use[shard]
        if not use:  # no maxmemory, or unread: most deployments, at no cost
            return None
        return use if use >= tier_mark(tier, self._high_water()) else None

    async def read(self) -> None:
        """Every shard's use now; the first failure raised once all were tried."""
        failed: BaseException | None = None
        for shard, store in enumerate(self._stores):
            try:
                use = await store.memory_use()
            except ResponseError as exc:  # (an ACL without INFO: no mark)
                self._unreadable_once(shard, exc)
                use = None
            except Exception as exc:  # (Redis away: its own checks refuse meanwhile)
                failed = failed or exc
                self.use[shard] = 0.0  # (not a stale reading: none until read again)
                continue
            self._record(shard, use or 0.0)
        past = max(self.use, default=0.0) >= self._high_water()
        self.loop.interval_s = READ_PAST_MARK_S if past else READ_EVERY_S
        if failed is not None:
            raise failed

    def _record(self, shard: int, use: float) -> None:
        high_water = self._high_water()
        was, self.use[shard] = self.use[shard], use
        if was < high_water <= use:
            log.warning("redis.memory_high", shard=shard, use=round(use, 3), high_water=high_water)
        elif use < high_water <= was:
            log.info("redis.memory_below_high_water", shard=shard, use=round(use, 3))

    def _unreadable_once(self, shard: int, exc: ResponseError) -> None:
        if shard not in self._unreadable:
            self._unreadable.add(shard)
            log.warning(
                "redis.memory_unread",
                shard=shard,
                error=str(exc)[:200],
                note="INFO is refused (an ACL without +info?): no high-water mark on this shard",
            )
