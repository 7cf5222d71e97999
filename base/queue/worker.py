"""What a worker may do in Redis: offer its credit, pull a batch into its
processing list, and answer the batch: publish its replies, store its jobs'
results and its answers for the cache, and ack it, in one transaction."""

from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from infergate.base import wire
from infergate.base.queue.replies import deliver_replies
from infergate.base.queue.scripts import execute, queue_on
from infergate.base.queue.store import Store
from redis.asyncio.client import Pipeline


class KeptAnswer(NamedTuple):
    """An answer for the result cache (``sharing.cache_ttl_s``)."""

    digest: str
    fingerprint: str
    output: str
    ttl_ms: int


# What answering a batch does with the worker's credit (ack_batch.lua).
Credit = Literal["none", "next"]


class WorkerQueue:
    def __init__(self, store: Store, worker_id: str) -> None:
        self.store = store
        self.keys = store.keys
        self.worker_id = worker_id

    async def offer_credit(self) -> None:
        """Say this worker is idle and can take one batch (idempotent)."""
        keys = self.keys
        await self.store.scripts.offer_credit(
            keys=[keys.ready, keys.doorbell, *keys.job_queues], args=[self.worker_id]
        )

    async def withdraw_credit(self) -> None:
        """A worker leaving takes its credit back."""
        await self.store.redis.lrem(self.keys.ready, 0, self.worker_id)

    async def ensure_credit(self) -> bool:
        """An idle worker re-offers its credit if Redis lost it (see ensure_credit.lua)."""
        members: set[bytes] = await self.store.redis.smembers(  # type: ignore[assignment]
            self.keys.members("dispatcher")
        )
        dispatchers = sorted(m.decode() for m in members)
        offered = await self.store.scripts.ensure_credit(
            keys=[self.keys.ready, self.keys.batches, *map(self.keys.credits, dispatchers)],
            args=[self.worker_id],
        )
        return bool(offered)

    async def pull_batch(self, timeout_s: float) -> bytes | None:
        """Block until a batch is handed to this worker; it lands in processing:{worker}."""
        return await self.store.move_oldest(
            self.keys.batches, self.keys.processing(self.worker_id), timeout_s
        )

    async def batch_in_hand(self) -> bytes | None:
        """The batch already in this worker's processing list, if any (a pull
        whose reply was lost still moved it there)."""
        data: bytes | None = await self.store.redis.lindex(  # type: ignore[assignment]
            self.keys.processing(self.worker_id), -1
        )
        return data

    async def answer_batch(
        self,
        replies: Mapping[str, wire.Reply],
        credit: Credit,
        now_ms: int,
        batch: bytes,
        keep: Sequence[KeptAnswer] = (),
    ) -> bytes | None:
        """Publish one reply per gateway and store the jobs' results, then ack
        ``batch`` and settle the worker's credit (``ack_batch.lua``: take it
        back, or leave it offered and take the next batch into processing,
        returned here), in one transaction: a job's result is
        stored by the same step that finishes its batch. If the reply to the
        transaction is lost, the batch is run again; gateways ignore the
        duplicate and a job's result is stored again. One round trip."""
        keys = self.keys

        def build(pipe: Pipeline) -> None:
            deliver_replies(pipe, self.store, replies, now_ms)
            for answer in keep:
                pipe.set(
                    keys.cache(answer.digest, answer.fingerprint), answer.output, px=answer.ttl_ms
                )
            queue_on(
                pipe,
                self.store.scripts.ack_batch,
                [keys.processing(self.worker_id), keys.ready, keys.batches],
                [self.worker_id, credit, batch],
            )

        results = await execute(self.store.redis, self.store.scripts, build)
        following: bytes | None = results[-1]
        return following
