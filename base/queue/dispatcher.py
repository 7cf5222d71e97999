"""What a dispatcher may do in Redis: hold an idle worker's credit, form a
batch with it and hand it off (one step), publish the batching rule for
workers that form their next batch themselves, and return what it holds
when it stops."""

from infergate.base import logs
from infergate.base.errors import wrong_type
from infergate.base.queue.forming import (
    RULE_TTL_MS,
    Rule,
    TakeResult,
    dispatch_take,
    encode_rule,
    take_result,
)
from infergate.base.queue.store import Store, process_ids
from infergate.base.tiers import TIERS
from redis.exceptions import ResponseError

log = logs.get(__name__)


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
        credits = self.keys.credits(self.dispatcher_id)
        try:
            credit = await self.store.move_oldest(self.keys.ready, credits, timeout_s)
        except ResponseError as exc:
            await self._planted_gone(exc, self.keys.ready, credits)
            return None
        if credit is None:
            return None
        ids, planted = process_ids([credit])
        if planted:  # not a worker's id (see process_ids): it goes
            # (redis-py sends bytes as they are; its stubs say str)
            await self.store.redis.lrem(credits, 0, credit)  # type: ignore[arg-type]
            log.warning("credit.unreadable")
            return None
        return ids[0]

    async def _planted_gone(self, exc: ResponseError, *names: str) -> None:
        """After a blocking pop's WRONGTYPE, those of ``names`` that are not
        lists (planted: Redis's contents are not trusted) go (idle workers
        offer their credits again; the next admit rings again); any other
        error is raised."""
        if not wrong_type(exc):
            raise exc
        for name in names:
            kind = await self.store.redis.type(name)
            if kind not in (b"list", b"none"):
                await self.store.redis.delete(name)
                log.warning("dispatcher.planted_key_gone", key=name, type=str(kind))

    async def take(
        self,
        credit: str,
        batch_id: str,
        now_ms: int,
        rule: Rule,
        with_envelopes: bool = False,
    ) -> TakeResult:
        """Form a batch of up to ``rule.n`` envelopes for the worker of
        ``credit`` and hand it off with the credit, in one step (``take_*.lua``):
        synchronous requests first; jobs after them, and alone only with
        ``rule.headroom`` other workers idle (-1: no jobs). Nothing if that
        worker has gone or the credit is no longer held here."""
        call = dispatch_take(
            self.keys, self.dispatcher_id, credit, batch_id, now_ms, rule, with_envelopes
        )
        # Straight on the held connection (``pipelined.py``): at low load this
        # call is on the way of every request that finds no idle worker's
        # credit on ready (one that does goes straight: admit.lua).
        script = self.store.scripts.take_dispatch
        return take_result(await self.store.pipelined.call(script, call.keys, call.args))

    async def publish_rule(self, rule: Rule) -> None:
        """The batching rule, for workers that form their next batch themselves."""
        await self.store.set_expiring(self.keys.batch_rule, encode_rule(rule), RULE_TTL_MS)

    async def drop_credit(self, credit: str) -> None:
        """Forget a held credit whose worker has gone."""
        await self.store.redis.lrem(self.keys.credits(self.dispatcher_id), 0, credit)

    async def wait_doorbell(self, timeout_s: float) -> bool:
        try:
            return await self.store.pop_first(self.keys.doorbell, timeout_s) is not None
        except ResponseError as exc:
            await self._planted_gone(exc, self.keys.doorbell)
            return True  # (a ring may have been lost with it: look at the queues)

    async def requeue_own(self) -> tuple[int, int]:
        return await requeue(self.store, self.dispatcher_id)
