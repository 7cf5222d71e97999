"""What a worker may do in Redis: offer its credit, pull a batch into its
processing list, form its next batch straight into that list the moment its
backend is free, and answer a batch: publish its replies, store its jobs'
results and its answers for the cache and ack it, in one transaction."""

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from infergate.base import wire
from infergate.base.queue import inputs, redis_url
from infergate.base.queue.forming import (
    TakeCall,
    TakeResult,
    credit_take,
    take_result,
    worker_take,
)
from infergate.base.queue.replies import reply_commands
from infergate.base.queue.scripts import evalsha, execute, queue_on, source
from infergate.base.queue.store import Store, process_ids
from infergate.base.queue.usage import Charge, charge_commands
from infergate.base.queue.warming import WORD_KEPT_MS
from redis.asyncio.client import Pipeline
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.retry import Retry


class KeptAnswer(NamedTuple):
    """An answer for the result cache (``sharing.cache_ttl_s``)."""

    digest: str
    fingerprint: str
    output: str
    ttl_ms: int


class WorkerQueue:
    def __init__(self, store: Store, worker_id: str, usage_retention_s: int = 35 * 86_400) -> None:
        self.store = store
        self.keys = store.keys
        self.worker_id = worker_id
        self.usage_retention_s = usage_retention_s  # (how long usage per key is kept)

    async def offer_credit(self) -> None:
        """Say this worker is idle and can take one batch (idempotent)."""
        keys = self.keys
        await self.store.scripts.offer_credit(
            keys=[
                keys.ready,
                keys.doorbell,
                *keys.job_queues,
                *keys.queues,
                *keys.fair_queues,
                *keys.job_fair_queues,
            ],
            args=[self.worker_id],
        )

    async def leave(self, keep_membership: bool = False) -> None:
        """A worker leaving, in one transaction: its heartbeat goes (no
        batch is handed to it after that: admit and take check it), its
        credit is taken back, and a batch handed to it and not pulled goes
        to the shared list, for the next worker free. With
        ``keep_membership`` (it leaves a batch in processing) the reaper
        then finds it dead and runs that batch again."""
        keys, worker_id = self.keys, self.worker_id

        def build(pipe: Pipeline) -> None:
            pipe.delete(keys.heartbeat("worker", worker_id))
            if not keep_membership:
                pipe.srem(keys.members("worker"), worker_id)
            pipe.lrem(keys.ready, 0, worker_id)
            pipe.delete(keys.withdrawn(worker_id))
            hand_back(pipe, self.store, worker_id)

        await execute(self.store.redis, self.store.scripts, build)

    async def step_aside(self) -> None:
        """A worker whose backend cannot serve now (its server is down):
        its credit off ``ready``, and any batch handed to it onto the shared
        ``batches``, for a worker that can run it. Its heartbeat stays (it
        says its server is down), and ``ensure_credit`` puts it back."""
        keys, worker_id = self.keys, self.worker_id

        def build(pipe: Pipeline) -> None:
            pipe.lrem(keys.ready, 0, worker_id)
            hand_back(pipe, self.store, worker_id)

        await execute(self.store.redis, self.store.scripts, build)

    async def warming(self, until_ms: int | None) -> None:
        """Say this worker is warming up until ``until_ms`` (None: done)."""
        pipe = self.store.redis.pipeline(transaction=False)
        if until_ms is None:
            pipe.zrem(self.keys.warming, self.worker_id)
        else:
            pipe.zadd(self.keys.warming, {self.worker_id: until_ms})
        pipe.pexpire(self.keys.warming, WORD_KEPT_MS)  # (the words of workers that died)
        await pipe.execute()

    async def forget_last_step(self) -> None:
        """A worker leaving with nothing in hand: its last step's token goes."""
        await self.store.redis.delete(self.keys.last_step(self.worker_id))

    async def ensure_credit(self) -> bool:
        """An idle worker re-offers its credit if Redis lost it (see ensure_credit.lua)."""
        # (with the hot path's calls: an idle worker makes these every second)
        (members,) = await self.store.commands(("SMEMBERS", self.keys.members("dispatcher")))
        dispatchers, _ = process_ids(members)  # (a planted member: the fleet view drops it)
        offered = await self.store.pipelined.call(
            self.store.scripts.ensure_credit,
            [
                self.keys.ready,
                self.keys.handoff(self.worker_id),
                self.keys.withdrawn(self.worker_id),
                *map(self.keys.credits, dispatchers),
            ],
            [self.worker_id],
        )
        return bool(offered)

    async def pull_batch(self, timeout_s: float) -> bytes | None:
        """Block until a batch is handed off with this worker's credit
        (``batches:{worker}``), or, after ``timeout_s`` with none, take one
        waiting on the shared ``batches`` (retried while no worker was
        idle, or handed back by one that left); it lands in
        processing:{worker}. One command a batch: the shared list is looked
        at only once idle."""
        processing = self.keys.processing(self.worker_id)
        handed = await self.store.move_oldest(
            self.keys.handoff(self.worker_id), processing, timeout_s
        )
        if handed is not None:
            return handed
        waiting: bytes | None = await self.store.pipelined.call(
            self.store.scripts.pull_waiting,
            [self.keys.batches, processing, self.keys.ready, self.keys.withdrawn(self.worker_id)],
            [self.worker_id],
        )
        return waiting or None

    async def with_inputs(
        self, envelopes: Sequence[wire.Envelope]
    ) -> tuple[list[wire.Envelope], list[wire.Envelope]]:
        """``envelopes`` with their long inputs in place, and those whose
        input is gone (``inputs.filled``): one MGET, in which Redis copies
        them into no script, if any is kept beside."""
        keys = inputs.input_keys(self.keys, envelopes)
        values: list[bytes | None] = []
        if keys:
            (values,) = await self.store.pipelined.transaction([("MGET", *keys)], ())
        return inputs.filled(envelopes, dict(zip(keys, values, strict=True)))

    async def batch_in_hand(self) -> bytes | None:
        """The batch already in this worker's processing list, if any (a pull
        whose reply was lost still moved it there)."""
        data: bytes | None = await self.store.redis.lindex(  # type: ignore[assignment]
            self.keys.processing(self.worker_id), -1
        )
        return data

    async def take_next(
        self,
        ran: bytes,
        step: str,
        now_ms: int,
        replies: Mapping[str, wire.Reply] | None = None,
        keep: Sequence[KeptAnswer] = (),
        inputs_done: Sequence[str] = (),
        usage: Sequence[Charge] = (),
    ) -> TakeResult:
        """The backend has just run ``ran`` (still in processing): form this
        worker's next batch straight into its processing list, beside it
        (``take_worker.lua``), or offer its credit when there is nothing
        to take; the batch is in ``TakeResult.batch``. If the reply is lost
        and the step runs again with the same ``step`` token, the same next
        batch comes back, and no second batch or credit goes out. One round
        trip, and a short one: as a rule the replies go out after the next
        batch has started (``answer_batch``). Given ``replies``, they are
        published, ``keep`` stored and ``ran`` acked in the same
        transaction, after the take, and its long inputs (``inputs_done``)
        deleted: for a small batch, whose few replies add little to the step
        and so reach their clients one round trip sooner."""
        scripts = self.store.scripts
        call = self.take_step(ran, step, now_ms, ack=replies is not None)
        # Straight on the held connection (``pipelined.py``): between two
        # backend calls (and at low load, on every request's way back),
        # redis-py's own way through costs more than the take.
        if replies is None:
            raw = await self.store.pipelined.call(scripts.take_worker, call.keys, call.args)
            return take_result(raw)
        commands = [
            evalsha(scripts.take_worker, call.keys, call.args),
            *self._answer_commands(replies, now_ms, keep, inputs_done, usage),
        ]
        results = await self.store.pipelined.transaction(commands, self._scripts)
        return take_result(results[0])

    def take_step(self, ran: bytes, step: str, now_ms: int, ack: bool) -> TakeCall:
        """This worker's step (``take_worker.lua``)."""
        return worker_take(self.keys, self.worker_id, now_ms, ran, step, ack)

    def credit_step(
        self,
        entry: Literal["take_join", "take_withdrawn"],
        now_ms: int,
        mark_ms: int = 0,
        room: int = 0,
    ) -> TakeCall:
        """This worker's idle credit while the backend it shares with other
        shards runs their batches: 'take_join' as a call starts (a batch of
        at most ``room`` for it, or the credit withdrawn, marked for
        ``mark_ms``), 'take_withdrawn' as it ends (given back)."""
        return credit_take(self.keys, entry, self.worker_id, now_ms, mark_ms, room)

    def blocking_take(self, url: str, timeout_s: float) -> "BlockingTake":
        """The same step (without an answer), on a blocking client of its own
        (named ``worker:{id}:thread`` in CLIENT LIST): for the backend's
        thread, which takes the next batch itself."""
        return BlockingTake(self, url, timeout_s)

    async def answer_batch(
        self,
        replies: Mapping[str, wire.Reply],
        now_ms: int,
        batch: bytes,
        keep: Sequence[KeptAnswer] = (),
        leaving: bool = False,
        inputs_done: Sequence[str] = (),
        usage: Sequence[Charge] = (),
    ) -> None:
        """Publish one reply per gateway, store the jobs' results and the
        answers to keep, delete the batch's long inputs (``inputs_done``),
        then ack ``batch``, in one transaction: a job's
        result is stored by the same step that finishes its batch. A worker
        ``leaving`` also takes back its credit (``ack_batch.lua``). If the
        reply to the transaction is lost, it is run again: gateways ignore
        the duplicate and a job's result is stored again. One round trip."""
        keys = self.keys
        processing = keys.processing(self.worker_id)
        ack: tuple[object, ...] = (
            evalsha(self.store.scripts.ack_batch, [processing, keys.ready], [self.worker_id, batch])
            if leaving
            else ("LREM", processing, 0, batch)
        )
        commands = [*self._answer_commands(replies, now_ms, keep, inputs_done, usage), ack]
        await self.store.pipelined.transaction(commands, self._scripts)

    async def publish_replies(self, replies: Mapping[str, wire.Reply]) -> None:
        """Only the replies to gateways, outside any transaction: what a
        Redis out of memory still takes (PUBLISH needs no memory; the
        answer's transaction, which stores and acks, waits until it frees)."""
        commands = [c for c in reply_commands(self.store, replies, 0) if c[0] == "PUBLISH"]
        if not commands:
            return
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            await pipe.execute()

    @property
    def _scripts(self) -> tuple[AsyncScript, ...]:
        """The scripts a worker's transactions run."""
        scripts = self.store.scripts
        return (scripts.take_worker, scripts.finish_jobs, scripts.ack_batch, scripts.charge_usage)

    def _answer_commands(
        self,
        replies: Mapping[str, wire.Reply],
        now_ms: int,
        keep: Sequence[KeptAnswer],
        inputs_done: Sequence[str],
        usage: Sequence[Charge] = (),
    ) -> list[tuple[Any, ...]]:
        """The replies, one per gateway (and the jobs' results), the answers
        to keep, the deleting of the long inputs answered, and what each
        key's requests cost (``usage.py``)."""
        commands = reply_commands(self.store, replies, now_ms)
        commands += charge_commands(self.store, usage, now_ms, self.usage_retention_s)
        for answer in keep:
            key = self.keys.cache(answer.digest, answer.fingerprint)
            commands.append(("SET", key, answer.output, "PX", answer.ttl_ms))
        if inputs_done:
            commands.append(("DEL", *inputs_done))
        return commands


class BlockingTake:
    """``WorkerQueue.take_next`` without an answer, from a thread with no
    event loop: ``take(ran, step, now_ms)``. A failure is raised, never
    retried here (the caller repeats the step with the same token)."""

    def __init__(self, queue: WorkerQueue, url: str, timeout_s: float) -> None:
        self._queue = queue
        # No retry: the step is repeated by its caller, with its token.
        self._client = redis_url.sync_client(
            url,
            timeout_s,
            retry=Retry(NoBackoff(), 0),
            client_name=f"worker:{queue.worker_id}:thread",
        )
        # NOSCRIPT (a restarted Redis) loads it and runs it again: it never ran.
        self._scripts = {
            entry: self._client.register_script(source(entry))
            for entry in ("take_worker", "take_join", "take_withdrawn")
        }

    def _run(self, call: TakeCall) -> TakeResult:
        return take_result(self._scripts[call.entry](call.keys, call.args))

    def __call__(self, ran: bytes, step: str, now_ms: int) -> TakeResult:
        return self._run(self._queue.take_step(ran, step, now_ms, ack=False))

    def join_call(self, now_ms: int, mark_ms: int, room: int) -> TakeResult:
        """The backend starts a call of another shard's batch, with ``room``
        inputs left: this worker's idle credit forms a batch of at most that
        for it onto the hand-off list (``TakeResult.size``), or is withdrawn
        until ``give_back_credit`` (``credit_lost``: it was not on ``ready``
        nor held by a dispatcher, and nothing was done)."""
        return self._run(self._queue.credit_step("take_join", now_ms, mark_ms, room))

    def give_back_credit(self, now_ms: int) -> TakeResult:
        """The call has ended: the credit withdrawn comes back, a batch
        formed now onto the hand-off list (``TakeResult.size``), or the
        credit onto ``ready``."""
        return self._run(self._queue.credit_step("take_withdrawn", now_ms))

    def with_inputs(
        self, envelopes: Sequence[wire.Envelope]
    ) -> tuple[list[wire.Envelope], list[wire.Envelope]]:
        """``WorkerQueue.with_inputs``, blocking."""
        keys = inputs.input_keys(self._queue.keys, envelopes)
        values: list[bytes | None] = self._client.mget(keys) if keys else []  # type: ignore[assignment]
        return inputs.filled(envelopes, dict(zip(keys, values, strict=True)))

    def close(self) -> None:
        self._client.close()


def hand_back(pipe: Pipeline, store: Store, worker_id: str) -> None:
    """Queue on ``pipe`` the move of everything waiting on ``worker_id``'s
    hand-off list to the shared ``batches`` list (``hand_back.lua``): a
    worker leaving or found dead. (Run it with ``scripts.execute``.)"""
    keys = store.keys
    queue_on(pipe, store.scripts.hand_back, [keys.handoff(worker_id), keys.batches], [])
