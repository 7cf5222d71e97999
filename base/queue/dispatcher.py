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
            *keys.queues,
        ],
        args=list(TIERS),
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
        self, n: int, now_ms: int, min_slots: Sequence[int], min_interval_ms: int = 0
    ) -> TakeResult:
        raw: Any = await self.store.scripts.take(
            keys=[
                self.keys.inflight(self.dispatcher_id),
                self.keys.stats,
                self.keys.doorbell,
                self.keys.cancelled,
                self.keys.last_dispatch,
                *self.keys.queues,
            ],
            args=[n, now_ms, min_interval_ms, *min_slots],
        )
        envelopes, expired, cancelled, malformed, wait_ms = raw
        return TakeResult(
            list(envelopes), int(expired), int(cancelled), int(malformed), int(wait_ms)
        )

    async def wait_doorbell(self, timeout_s: float) -> bool:
        return await self.store.redis.blpop([self.keys.doorbell], timeout_s) is not None

    async def handoff(self, credit: str, batch: bytes, size: int, now_ms: int) -> bool:
        """True if handed off; False if what this dispatcher held was taken back
        (by the reaper, while it stalled): then nothing changed."""
        handed = await self.store.scripts.handoff(
            keys=[
                self.keys.inflight(self.dispatcher_id),
                self.keys.batches,
                self.keys.credits(self.dispatcher_id),
                self.keys.stats,
                self.keys.last_dispatch,
            ],
            args=[batch, credit, size, now_ms],
        )
        return bool(handed)

    async def requeue_own(self) -> tuple[int, int]:
        return await requeue(self.store, self.dispatcher_id)
