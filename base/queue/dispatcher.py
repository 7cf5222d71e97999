"""What a dispatcher may do in Redis: hold an idle worker's credit, form a
batch with it and hand it off (one step), and return what it holds when it
stops."""

from collections.abc import Sequence
from typing import Any

import msgspec
from infergate.base.queue.store import Store
from infergate.base.tiers import TIERS


class TakeResult(msgspec.Struct, frozen=True):
    # The batch handed off: its size, and its envelopes when asked for.
    size: int
    envelopes: list[bytes]
    expired: int
    cancelled: int
    malformed: int
    # > 0: pacing says come back after this many ms (nothing was taken).
    wait_ms: int = 0
    # How many of the envelopes are jobs.
    jobs: int = 0
    # The credit's worker has gone (stopped, or died) while the credit was held.
    worker_gone: bool = False
    # The credit is no longer this dispatcher's (the reaper took it back).
    credit_lost: bool = False


# A fleet with no synchronous batch for this long runs jobs without headroom.
JOBS_QUIET_MS = 2_000


async def requeue(store: Store, dispatcher_id: str) -> tuple[int, int]:
    """Return a dispatcher's held credits to ``ready`` (its own stop, or the
    reaper's), and any envelopes in its inflight list to the front of their
    queues: ``take`` no longer puts any there, but a dispatcher of an earlier
    version may have, before an upgrade."""
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
        batch_id: str,
        n: int,
        now_ms: int,
        min_slots: Sequence[int],
        min_interval_ms: int = 0,
        jobs_headroom: int = -1,
        with_envelopes: bool = False,
    ) -> TakeResult:
        """Form a batch of up to ``n`` envelopes for the worker of ``credit``
        and hand it off with the credit, in one step (``take.lua``):
        synchronous requests first; jobs after them, and alone only with
        ``jobs_headroom`` other workers idle (-1: no jobs). Nothing if that
        worker has gone or the credit is no longer held here."""
        keys = self.keys
        raw: Any = await self.store.scripts.take(
            keys=[
                keys.credits(self.dispatcher_id),
                keys.stats,
                keys.doorbell,
                keys.cancelled,
                keys.last_dispatch,
                keys.ready,
                keys.jobs_queued,
                keys.heartbeat("worker", credit),
                keys.batches,
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
                credit,
                batch_id,
                self.dispatcher_id,
                "1" if with_envelopes else "0",
                *min_slots,
            ],
        )
        envelopes, expired, cancelled, malformed, wait_ms, jobs, gone, size, lost = raw
        return TakeResult(
            int(size),
            list(envelopes),
            int(expired),
            int(cancelled),
            int(malformed),
            int(wait_ms),
            int(jobs),
            bool(gone),
            bool(lost),
        )

    async def drop_credit(self, credit: str) -> None:
        """Forget a held credit whose worker has gone."""
        await self.store.redis.lrem(self.keys.credits(self.dispatcher_id), 0, credit)

    async def wait_doorbell(self, timeout_s: float) -> bool:
        return await self.store.redis.blpop([self.keys.doorbell], timeout_s) is not None

    async def requeue_own(self) -> tuple[int, int]:
        return await requeue(self.store, self.dispatcher_id)
