"""What a dispatcher may do in Redis: hold an idle worker's credit, take
envelopes into its inflight list, hand them off as one batch, and return
what it holds when it stops."""

from collections.abc import Sequence
from typing import Any

import msgspec
from infergate.base.queue.store import Store
from infergate.base.tiers import TIERS


class TakeResult(msgspec.Struct, frozen=True):
    envelopes: list[bytes]
    expired: int
    cancelled: int
    malformed: int
    # > 0: pacing says come back after this many ms (nothing was taken).
    wait_ms: int = 0
    # How many of the envelopes are jobs (a batch of jobs only is not paced).
    jobs: int = 0
    # The credit's worker has gone (stopped, or died) while the credit was held.
    worker_gone: bool = False


# A fleet with no synchronous batch for this long runs jobs without headroom.
JOBS_QUIET_MS = 2_000


async def requeue(store: Store, dispatcher_id: str) -> tuple[int, int]:
    """Return a dispatcher's inflight envelopes to the front of their queues
    and its held credits to ``ready`` (its own stop, or the reaper's)."""
    keys = store.keys
    envs, credits = await store.scripts.requeue(
        keys=[
            keys.inflight(dispatcher_id),
            keys.credits(dispatcher_id),
            keys.ready,
            keys.doorbell,
            keys.stats,
            keys.jobs_queued,
            *keys.job_queues,
            *keys.queues,  # last: the queue of whatever cannot be read
        ],
        args=[keys.job_prefix, *("job:" + t for t in TIERS), *TIERS],
    )
    return int(envs), int(credits)


class DispatcherQueue:
    def __init__(self, store: Store, dispatcher_id: str) -> None:
        self.store = store
        self.keys = store.keys
        self.dispatcher_id = dispatcher_id

    async def wait_credit(self, timeout_s: float) -> str | None:
        """Block until an idle worker's credit is free, and hold it in
        ``credits:{dispatcher}`` (returned to ``ready`` if this dispatcher dies)."""
        credit = await self.store.move_oldest(
            self.keys.ready, self.keys.credits(self.dispatcher_id), timeout_s
        )
        return None if credit is None else credit.decode()

    async def take(
        self,
        credit: str,
        n: int,
        now_ms: int,
        min_slots: Sequence[int],
        min_interval_ms: int = 0,
        jobs_headroom: int = -1,
    ) -> TakeResult:
        """Up to ``n`` envelopes for the worker of ``credit``, synchronous ones
        first; jobs after them, and alone only with ``jobs_headroom`` other
        workers idle (-1: no jobs). Nothing if that worker has gone."""
        keys = self.keys
        raw: Any = await self.store.scripts.take(
            keys=[
                keys.inflight(self.dispatcher_id),
                keys.stats,
                keys.doorbell,
                keys.cancelled,
                keys.last_dispatch,
                keys.ready,
                keys.jobs_queued,
                keys.heartbeat("worker", credit),
                *keys.queues,
                *keys.job_queues,
            ],
            args=[
                n,
                now_ms,
                min_interval_ms,
                jobs_headroom,
                keys.job_prefix,
                JOBS_QUIET_MS,
                *min_slots,
            ],
        )
        envelopes, expired, cancelled, malformed, wait_ms, jobs, gone = raw
        return TakeResult(
            list(envelopes),
            int(expired),
            int(cancelled),
            int(malformed),
            int(wait_ms),
            int(jobs),
            bool(gone),
        )

    async def drop_credit(self, credit: str) -> None:
        """Forget a held credit whose worker has gone."""
        await self.store.redis.lrem(self.keys.credits(self.dispatcher_id), 0, credit)

    async def wait_doorbell(self, timeout_s: float) -> bool:
        return await self.store.redis.blpop([self.keys.doorbell], timeout_s) is not None

    async def handoff(
        self, credit: str, batch: bytes, size: int, now_ms: int, paced: bool = True
    ) -> bool:
        """True if handed off; False if what this dispatcher held was taken back
        (by the reaper, while it stalled): then nothing changed. ``paced``: the
        hand-off counts for pacing (a batch of jobs only does not)."""
        handed = await self.store.scripts.handoff(
            keys=[
                self.keys.inflight(self.dispatcher_id),
                self.keys.batches,
                self.keys.credits(self.dispatcher_id),
                self.keys.stats,
                self.keys.last_dispatch,
            ],
            args=[batch, credit, size, now_ms, "1" if paced else "0"],
        )
        return bool(handed)

    async def requeue_own(self) -> tuple[int, int]:
        return await requeue(self.store, self.dispatcher_id)
