"""The data model's atomic moves, through each role's face of the queue
layer, against a real Redis."""

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest
from infergate.base import clock, wire
from infergate.base.errors import STORE_ERRORS
from infergate.base.keys import Keys
from infergate.base.queue import scripts
from infergate.base.queue.dead_letters import DEAD_LETTER_CAP
from infergate.base.queue.dispatcher import DispatcherQueue
from infergate.base.queue.forming import Rule, TakeResult
from infergate.base.queue.gateway import Counter, GatewayQueue
from infergate.base.queue.recovery import RecoveryQueue
from infergate.base.queue.store import Store
from infergate.base.queue.worker import WorkerQueue
from infergate.base.tiers import TIERS
from infergate.redis_server import RedisServer

from tests.helpers import queued, until


def env(i: int, tier: str, deadline_in_ms: int = 10_000) -> bytes:
    now = clock.now_ms()
    return wire.encode_queued(
        wire.Envelope(f"r{i}", "gw", tier, "k", f"in{i}", now, now + deadline_in_ms)
    )


async def charged(q: "Faces", window: str) -> int:
    """What a limit's sliding window holds (admit.lua): its buckets' sum
    (and it is the sum the window keeps, 's')."""
    fields = await q.redis.hgetall(window)
    buckets = sum(int(v) for k, v in fields.items() if k not in (b"l", b"s"))
    assert buckets == int(fields.get(b"s", 0))
    return buckets


@dataclass
class Faces:
    store: Store
    gateway: GatewayQueue
    dispatcher: DispatcherQueue
    worker: WorkerQueue
    recovery: RecoveryQueue

    @property
    def redis(self):  # for the assertions: what is really in Redis
        return self.store.redis

    @property
    def keys(self):
        return self.store.keys

    def dispatcher_as(self, dispatcher_id: str) -> DispatcherQueue:
        return DispatcherQueue(self.store, dispatcher_id)

    async def stats(self) -> dict[str, int]:
        return (await self.store.fleet_status()).counters


@pytest.fixture
async def q(redis_url: str):
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    # The worker whose credit the dispatchers hold in these tests is alive.
    await store.redis.set(store.keys.heartbeat("worker", "w1"), b"{}")
    yield Faces(
        store,
        GatewayQueue(store, "gw"),
        DispatcherQueue(store, "d1"),
        WorkerQueue(store, "w1"),
        RecoveryQueue(store, "reaper-1"),
    )
    await store.close()


def ids(envelopes: list[bytes]) -> list[str]:
    return [wire.decode_envelope(e).id for e in envelopes]


def rule(n: int, slots: list[int] | None = None, interval_ms: int = 0, headroom: int = -1) -> Rule:
    return Rule(n, interval_ms, headroom, min_slots=tuple(slots or [0, 0, 0]))


async def take(
    q: Faces,
    n: int,
    slots: list[int] | None = None,
    dispatcher: str = "d1",
    now: int | None = None,
    min_interval_ms: int = 0,
    jobs_headroom: int = -1,
) -> TakeResult:
    """A batch formed by ``dispatcher`` with a credit of w1 it holds."""
    await q.redis.rpush(q.keys.credits(dispatcher), "w1")
    return await q.dispatcher_as(dispatcher).take(
        "w1",
        "b1",
        now or clock.now_ms(),
        rule(n, slots, min_interval_ms, jobs_headroom),
        with_envelopes=True,
    )


async def test_a_batch_of_long_inputs_is_the_same_bytes_as_its_python_twin(q: Faces) -> None:
    """Past 64 KB a batch is joined in groups of 16 (``take_*.lua``
    ``joined``): any count, the same bytes as ``wire.encode_batch``."""
    now = clock.now_ms()
    for count in (1, 15, 16, 17, 33, 100):
        for i in range(count):
            text = f"in{i}-" + "x" * 3000
            envelope = wire.Envelope(f"r{i}", "gw", "paid", "k", text, now, now + 10_000)
            await q.gateway.enqueue("paid", wire.encode(envelope))
        taken = await take(q, 100)
        assert taken.size == count
        data = await q.redis.rpop(q.keys.handoff("w1"))
        assert data == wire.encode_batch("b1", "d1", now_of(data), taken.envelopes), count


def now_of(data: bytes) -> int:
    return wire.decode_batch(data)[0].formed_ms


async def test_take_is_priority_ordered_and_fifo_within_a_tier(q: Faces) -> None:
    for i, tier in enumerate(["free", "paid", "free", "enterprise", "paid", "enterprise"]):
        await q.gateway.enqueue(tier, env(i, tier))
    taken = await take(q, 5)
    assert ids(taken.envelopes) == ["r3", "r5", "r1", "r4", "r0"]
    # Handed off in the same step, as one batch, with the credit spent, to
    # the worker whose credit it was.
    (data,) = await q.redis.lrange(q.keys.handoff("w1"), 0, -1)
    batch, unreadable = wire.decode_batch(data)
    assert (batch.id, batch.dispatcher, unreadable) == ("b1", "d1", 0)
    assert [e.id for e in batch.envelopes] == ["r3", "r5", "r1", "r4", "r0"]
    # The same bytes as its Python twin writes, envelopes unchanged.
    assert data == wire.encode_batch("b1", "d1", batch.formed_ms, taken.envelopes)
    assert await q.redis.llen(q.keys.credits("d1")) == 0
    assert (await q.stats())["requests_batched"] == 5
    assert await queued(q.store, "free") == 1
    # Work was left behind: the doorbell rang again for another dispatcher.
    assert await q.redis.llen(q.keys.doorbell) == 1


async def test_keys_a_take_writes_planted_of_another_type_go_first(q: Faces) -> None:
    """Redis contents are not trusted: the stats, the cancelled set, ready,
    jobs-queued, last-dispatch, the doorbell or a tier's requeue list of
    another type goes, and the take forms its batch (before: a WRONGTYPE after the
    envelopes were popped lost them, and every take after it failed)."""
    await q.gateway.enqueue("free", env(1, "free"))
    await q.gateway.enqueue("paid", env(2, "paid"))
    shared = (q.keys.stats, q.keys.cancelled, q.keys.ready, q.keys.jobs_queued, q.keys.doorbell)
    for name in shared:
        await q.redis.set(name, "planted")
    await q.redis.hset(q.keys.last_dispatch, "planted", 1)
    await q.redis.hset(q.keys.queue("enterprise"), "planted", 1)
    taken = await take(q, 1, min_interval_ms=100)
    assert ids(taken.envelopes) == ["r2"]
    assert taken.malformed == 1  # (the requeue list that was none)
    assert await q.redis.lrange(q.keys.doorbell, 0, -1) == [b"1"]  # (work is left: rung)
    assert ids((await take(q, 10)).envelopes) == ["r1"]
    assert (await q.stats())["requests_batched"] == 2
    assert not await q.redis.exists(q.keys.queue("enterprise"))
    # A credit's list or the doorbell planted: the dispatcher's waits clear them.
    await q.redis.set(q.keys.ready, "planted")
    assert await q.dispatcher.wait_credit(0.1) is None
    await q.worker.offer_credit()
    assert await q.dispatcher.wait_credit(1) == "w1"
    await q.redis.set(q.keys.doorbell, "planted")
    assert await q.dispatcher.wait_doorbell(0.1)
    assert not await q.redis.exists(q.keys.doorbell)


async def test_min_share_is_served_before_strict_priority(q: Faces) -> None:
    for i in range(10):
        await q.gateway.enqueue("enterprise", env(i, "enterprise"))
    for i in range(10, 15):
        await q.gateway.enqueue("free", env(i, "free"))
    taken = await take(q, 10, [0, 0, 2])
    assert ids(taken.envelopes) == ["r10", "r11", *[f"r{i}" for i in range(8)]]


async def test_expired_and_cancelled_never_leave_the_queue_for_a_worker(q: Faces) -> None:
    await q.gateway.enqueue("free", env(1, "free", deadline_in_ms=-1))
    await q.gateway.enqueue("free", env(2, "free"))
    await q.gateway.enqueue("free", env(3, "free"))
    await q.gateway.cancel("r2", clock.now_ms() + 60_000)
    taken = await take(q, 10)
    assert ids(taken.envelopes) == ["r3"]
    assert (taken.expired, taken.cancelled) == (1, 1)
    stats = await q.stats()
    assert stats["expired_dropped"] == 1
    assert stats["cancelled_dropped"] == 1


async def test_cancelled_marks_past_their_deadline_go_without_a_take(q: Faces) -> None:
    # takes that find nothing queued read nothing, the cancelled set included:
    # the marks past their deadline go as new ones come, so a stream of
    # abandoned requests never grows it beyond those still within a deadline
    await q.gateway.cancel("r1", clock.now_ms() - 1)
    await q.gateway.cancel_all(["r2", "r3"], clock.now_ms() - 1)
    assert sorted(await q.redis.zrange(q.keys.cancelled, 0, -1)) == [b"r2", b"r3"]
    await q.gateway.cancel("r4", clock.now_ms() + 60_000)
    assert await q.redis.zrange(q.keys.cancelled, 0, -1) == [b"r4"]
    await q.gateway.cancel(
        "r5", clock.now_ms() + 60_000, [(Counter("tokens:x", 1, 10, 60), clock.now_ms(), 1)]
    )
    assert await q.redis.zrange(q.keys.cancelled, 0, -1) == [b"r4", b"r5"]


async def test_handoff_and_worker_round_trip(q: Faces) -> None:
    await q.worker.offer_credit()
    assert await q.dispatcher.wait_credit(1) == "w1"
    await q.gateway.enqueue("paid", env(1, "paid"))
    taken = await q.dispatcher.take("w1", "b1", clock.now_ms(), rule(100))
    assert taken.size == 1
    assert taken.envelopes == []  # not asked for
    assert await q.redis.llen(q.keys.credits("d1")) == 0
    data = await q.worker.pull_batch(1)
    assert data is not None
    decoded, unreadable = wire.decode_batch(data)
    assert unreadable == 0
    assert decoded.id == "b1"
    assert [e.id for e in decoded.envelopes] == ["r1"]
    assert await q.redis.llen(q.keys.processing("w1")) == 1
    pubsub = q.redis.pubsub()
    await pubsub.subscribe(q.keys.reply_channel("gw"))
    reply = wire.Reply([wire.Result("r1", "b1", 1, "w1", 0, 100, output="out")])
    # The backend is free and nothing is queued: the credit goes out, and
    # the batch stays in processing until its replies are out.
    taken = await q.worker.take_next(data, "s", clock.now_ms())
    assert taken.batch is None
    assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]
    assert await q.redis.llen(q.keys.processing("w1")) == 1
    await q.worker.answer_batch({"gw": reply}, clock.now_ms(), data)
    assert await q.redis.llen(q.keys.processing("w1")) == 0
    msg = None
    for _ in range(20):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg:
            break
    assert msg is not None
    assert wire.decode_reply(msg["data"]) == reply
    await pubsub.aclose()


async def test_requeue_returns_credits_and_an_older_dispatchers_inflight_in_order(
    q: Faces,
) -> None:
    for i in range(4):
        await q.gateway.enqueue("free", env(i, "free"))
    await q.worker.offer_credit()
    await q.dispatcher.wait_credit(1)
    # What a dispatcher of an earlier version left in its inflight list.
    for _ in range(3):
        ((oldest, _),) = await q.redis.zpopmin(q.keys.fair_queue("free"))
        await q.redis.rpush(q.keys.inflight("d1"), oldest)
    await q.gateway.enqueue("free", env(9, "free"))
    assert await q.dispatcher.requeue_own() == (3, 1)
    assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]
    taken = await take(q, 10, dispatcher="d2")
    assert ids(taken.envelopes) == ["r0", "r1", "r2", "r3", "r9"]


async def test_pacing_holds_a_partial_batch_but_never_a_full_one(q: Faces) -> None:
    now = clock.now_ms()
    await q.redis.set(q.keys.last_dispatch, now)
    await q.gateway.enqueue("free", env(1, "free"))
    held = await take(q, 3, now=now + 5, min_interval_ms=25)
    assert held.envelopes == []
    assert held.size == 0
    assert 0 < held.wait_ms <= 20
    for i in range(2, 4):
        await q.gateway.enqueue("free", env(i, "free"))
    full = await take(q, 3, now=now + 5, min_interval_ms=25)
    assert ids(full.envelopes) == ["r1", "r2", "r3"]
    # A hand-off stamped by a clock ten minutes ahead holds back one interval, no more.
    await q.redis.set(q.keys.last_dispatch, now + 600_000)
    await q.gateway.enqueue("free", env(4, "free"))
    skewed = await take(q, 3, now=now + 10, min_interval_ms=25)
    assert 0 < skewed.wait_ms <= 25


async def test_a_take_with_nothing_waiting_puts_the_credit_back_on_ready(q: Faces) -> None:
    """There a lone request goes straight from its gateway to the worker,
    and the dispatcher waits on the doorbell holding nothing. With work
    waiting that it may not take yet (pacing, jobs short of headroom), the
    credit stays held, and nothing rings (the dispatcher would wake itself)."""
    await q.worker.offer_credit()
    assert await q.dispatcher.wait_credit(1) == "w1"
    taken = await q.dispatcher.take("w1", "b1", clock.now_ms(), rule(100))
    assert (taken.size, taken.offered, taken.wait_ms) == (0, True, 0)
    assert await q.redis.llen(q.keys.credits("d1")) == 0
    assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]
    assert await q.redis.llen(q.keys.doorbell) == 0
    await q.dispatcher.publish_rule(rule(10))
    counter = Counter(q.gateway.counter_key("k"), 1, 100, 60)
    alone = await q.gateway.admit([counter], "paid", env(9, "paid"), straight=True)
    assert alone.handed  # straight to w1, no dispatcher on its way
    assert await q.redis.llen(q.keys.handoff("w1")) == 1
    await q.redis.delete(q.keys.handoff("w1"), q.keys.last_dispatch)
    now = clock.now_ms()
    await q.redis.set(q.keys.last_dispatch, now)
    await q.gateway.enqueue("free", env(1, "free"))
    paced = await take(q, 3, now=now + 5, min_interval_ms=25)
    assert (paced.size, paced.offered) == (0, False)
    assert paced.wait_ms > 0
    await q.redis.delete(q.keys.fair_queue("free"), q.keys.fair_state("free"), q.keys.credits("d1"))
    job = wire.Envelope("j1", "gw", "paid", "k", "job", now, now + 60_000, job=True)
    assert await q.gateway.enqueue_job(job, max_queued=10, result_ttl_ms=60_000)
    await q.redis.delete(q.keys.doorbell)
    short = await take(q, 10, now=now, jobs_headroom=5)
    assert (short.size, short.offered) == (0, False)
    assert await q.redis.lrange(q.keys.credits("d1"), 0, -1) == [b"w1"]
    assert await q.redis.llen(q.keys.doorbell) == 0


async def test_concurrent_takes_never_share_an_envelope(q: Faces) -> None:
    for i in range(300):
        await q.gateway.enqueue(TIERS[i % 3], env(i, TIERS[i % 3]))
    results = await asyncio.gather(*(take(q, 40, dispatcher=f"d{j}") for j in range(10)))
    all_ids = [i for r in results for i in ids(r.envelopes)]
    assert len(all_ids) == len(set(all_ids)) == 300
    assert await q.redis.llen(q.keys.handoff("w1")) == 8  # 300 in batches of 40


def test_envelope_wire_format_round_trips() -> None:
    e = wire.Envelope("id", "gw", "free", "k", 'ünï "quoted"', 1, 2)
    assert wire.decode_envelope(wire.encode(e)) == e
    with pytest.raises(msgspec.DecodeError):
        wire.decode_envelope(b"{}")


def test_a_queued_envelope_holds_its_input_last() -> None:
    """What take_*.lua reads of a queued envelope is everything before its
    input: the same object, in another order (a key id holding the field's
    own name, quoted, changes nothing)."""
    for text in ('ünï "quoted" ,"input":', None):
        e = wire.Envelope('i"d', "gw", "free", 'k,"input":', text, 1, 2, trace="t")
        if text is None:
            e = msgspec.structs.replace(e, input_key="in:k", input_chars=5)
        raw = wire.encode_queued(e)
        assert wire.decode_envelope(raw) == e
        assert raw.endswith(b',"input":' + msgspec.json.encode(text) + b"}")
        assert raw.count(b',"input":') == 1


async def test_take_reads_an_envelope_before_its_input_and_an_earlier_one_whole(
    q: Faces,
) -> None:
    """take_*.lua checks a queued envelope by what comes before its input; an
    envelope of an earlier version (its input in the middle) is decoded
    whole and taken too. An input that is no string is dropped as
    malformed; one whose escapes are broken goes unread to the worker,
    which drops that envelope alone (wire.decode_batch). A field repeated
    after the input (planted) is read as the worker reads it, the last one:
    here a deadline long past."""
    now = clock.now_ms()
    earlier = wire.encode(wire.Envelope("earlier", "gw", "paid", "k", "in", now, now + 10_000))
    late = wire.encode(wire.Envelope("late", "gw", "paid", "k", "in", now, now - 1))
    head = b'{"id":"%s","gateway":"gw","tier":"paid","key_id":"k","deadline_ms":9000000000000000'
    for raw in (
        earlier,
        late,
        head % b"number" + b',"input":5}',
        head % b"no-key" + b',"input":null}',
        head % b"broken" + rb',"input":"an \"escape\" \q"}',
        head % b"twice" + rb',"input":"x","deadline_ms":1,"z":""}',
        env(1, "paid"),
    ):
        await q.redis.lpush(q.keys.queue("paid"), raw)
    taken = await take(q, 10)
    assert (taken.size, taken.expired, taken.malformed) == (3, 2, 2)
    batch, unreadable = wire.decode_batch(await q.redis.rpop(q.keys.handoff("w1")))
    assert ([e.id for e in batch.envelopes], unreadable) == (["earlier", "r1"], 1)


async def test_malformed_envelopes_are_dropped_by_take_and_survive_requeue(q: Faces) -> None:
    junk = [b"not json", b"[1, 2]", b'{"id": "x"}', b'{"id": 1, "deadline_ms": 9e15}']
    for raw in junk:
        await q.redis.lpush(q.keys.queue("paid"), raw)
    await q.gateway.enqueue("paid", env(1, "paid"))
    taken = await take(q, 10)
    assert ids(taken.envelopes) == ["r1"]
    assert taken.malformed == len(junk)
    assert (await q.stats())["malformed_dropped"] == len(junk)
    # requeue puts an unreadable inflight envelope (an earlier version's) back
    # (on the last queue) instead of failing the whole script, and take drops it.
    await q.redis.rpush(q.keys.inflight("d1"), b"\xff garbage")
    assert await q.dispatcher.requeue_own() == (1, 0)
    again = await take(q, 10)
    assert again.envelopes == []
    assert again.malformed == 1


async def test_the_reaper_lock_is_held_by_one_owner_and_released_only_by_it(q: Faces) -> None:
    other = RecoveryQueue(q.store, "reaper-2")

    async def holds(recovery: RecoveryQueue) -> bool:  # (a look at no role: the lock alone)
        return await recovery.look((), 2_000) is not None

    assert await holds(q.recovery)
    assert not await holds(other)
    assert await holds(q.recovery)  # extends its own
    await other.release_lock()  # not the holder: changes nothing
    assert not await holds(other)
    await q.recovery.release_lock()
    assert await holds(other)
    # A lock that expired and was taken by another is not extended by the old owner.
    await q.redis.pexpire(q.keys.reaper_lock, 1)

    async def expired() -> bool:
        return not await q.redis.exists(q.keys.reaper_lock)

    await until(expired, 5, "the lock to expire")
    assert await holds(q.recovery)
    assert not await holds(other)


async def test_the_reapers_look_reads_the_fleet_only_with_the_lock(q: Faces) -> None:
    """One step takes the lock and reads who is dead: every role at once,
    an expired, an unreadable and a live heartbeat told apart, a planted
    members key of another type dropped; the owner without the lock reads
    nothing."""
    now = clock.now_ms()
    await q.store.beat(wire.Heartbeat("worker", "w-ok", now, now), 5_000)
    await q.redis.sadd(q.keys.members("worker"), "w-gone", "w-bad")
    await q.redis.set(q.keys.heartbeat("worker", "w-bad"), b"\x00 not a heartbeat")
    await q.redis.sadd(q.keys.members("dispatcher"), "d-gone")
    await q.redis.set(q.keys.members("gateway"), b"planted")
    other = RecoveryQueue(q.store, "reaper-2")
    assert await other.look(("worker",), 2_000) == {"worker": ["w-bad", "w-gone"]}
    assert await q.redis.exists(q.keys.heartbeat("worker", "w-bad")) == 0
    assert await q.recovery.look(("dispatcher", "worker", "gateway"), 2_000) is None
    assert await q.redis.type(q.keys.members("gateway")) == b"string"  # (not read)
    await other.release_lock()
    dead = await q.recovery.look(("dispatcher", "worker", "gateway"), 2_000)
    assert dead == {"dispatcher": ["d-gone"], "worker": ["w-bad", "w-gone"]}
    assert await q.redis.exists(q.keys.members("gateway")) == 0
    assert await q.redis.get(q.keys.reaper_lock) == q.recovery.owner_id.encode()


async def _batch_in_processing(q: Faces, attempt: int = 0) -> bytes:
    await q.worker.offer_credit()
    assert await q.dispatcher.wait_credit(1) == "w1"
    for i in range(3):
        await q.gateway.enqueue("free", env(i, "free"))
    taken = await q.dispatcher.take("w1", "b1", clock.now_ms(), rule(10))
    assert taken.size == 3
    data = await q.worker.pull_batch(1)
    assert data is not None
    return data


async def test_a_worker_dead_between_two_batches_has_both_retried_the_older_first(
    q: Faces,
) -> None:
    """It died with the batch it ran not yet answered and the next one
    started: both go back to the batches list, the older nearer the front."""
    ran = await _batch_in_processing(q)
    await q.dispatcher.publish_rule(rule(10))
    await q.gateway.enqueue("paid", env(7, "paid"))
    following = (await _take(q, ran)).batch
    assert following is not None
    assert await q.recovery.recover_worker("w1", max_attempts=2) == ["retried", "retried"]
    assert await q.redis.llen(q.keys.processing("w1")) == 0
    retried = [wire.decode_batch(b)[0] for b in await q.redis.lrange(q.keys.batches, 0, -1)]
    # The batches list is pulled from the right.
    assert [[e.id for e in b.envelopes] for b in retried] == [["r7"], ["r0", "r1", "r2"]]
    assert all(b.attempt == 1 for b in retried)


async def test_a_stalled_dispatcher_forms_nothing_with_a_credit_the_reaper_took_back(
    q: Faces,
) -> None:
    await q.worker.offer_credit()
    assert await q.dispatcher.wait_credit(1) == "w1"
    await q.gateway.enqueue("paid", env(1, "paid"))
    # The dispatcher stalls past its heartbeat: the reaper returns its credit.
    assert await q.recovery.requeue_dispatcher("d1") == (0, 1)
    taken = await q.dispatcher.take("w1", "b1", clock.now_ms(), rule(10))
    assert taken.credit_lost
    assert taken.size == 0
    assert await q.redis.llen(q.keys.batches) == 0  # nothing runs twice
    assert await queued(q.store, "paid") == 1
    assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]


async def test_a_dead_workers_batch_is_retried_then_dead_lettered_and_answered(q: Faces) -> None:
    await _batch_in_processing(q)
    assert await q.recovery.recover_worker("w1", max_attempts=2) == ["retried"]
    retried = await q.redis.lrange(q.keys.batches, 0, -1)
    assert len(retried) == 1
    assert wire.decode_batch(retried[0])[0].attempt == 1
    # The retried batch dies with its next worker too: now it is the last attempt.
    await q.redis.lmove(q.keys.batches, q.keys.processing("w1"), "RIGHT", "LEFT")
    pubsub = q.redis.pubsub()
    await pubsub.subscribe(q.keys.reply_channel("gw"))
    assert await q.recovery.recover_worker("w1", max_attempts=2) == ["dead_lettered"]
    assert await q.redis.llen(q.keys.processing("w1")) == 0
    assert await q.redis.llen(q.keys.dead_letter) == 1
    message = None
    for _ in range(20):
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            break
    await pubsub.aclose()
    assert message is not None
    results = wire.decode_reply(message["data"]).results
    assert sorted(r.id for r in results) == ["r0", "r1", "r2"]
    assert all(r.error is not None and r.error.code == "INFERENCE_FAILED" for r in results)
    # Run twice (two reapers racing): the batch moves once.
    assert await q.recovery.recover_worker("w1", max_attempts=2) == []


async def test_the_dead_letter_list_is_capped(q: Faces) -> None:
    for i in range(DEAD_LETTER_CAP + 5):
        await q.redis.rpush(q.keys.processing("w1"), f"junk-{i}")
        await q.recovery.dead_letter_unreadable("w1", f"junk-{i}".encode())
    assert await q.redis.llen(q.keys.dead_letter) == DEAD_LETTER_CAP
    # the newest are kept
    assert await q.redis.lindex(q.keys.dead_letter, 0) == f"junk-{DEAD_LETTER_CAP + 4}".encode()


async def test_an_unreadable_heartbeat_hides_nothing_and_counts_as_dead(q: Faces) -> None:
    now = clock.now_ms()
    await q.store.beat(wire.Heartbeat("worker", "w-ok", now, now, batch_ms=100.0), 5_000)
    await q.redis.sadd(q.keys.members("worker"), "w-bad")
    await q.redis.set(q.keys.heartbeat("worker", "w-bad"), b"\x00 not a heartbeat")
    snapshot = await q.store.fleet_snapshot(now)
    assert [w.id for w in snapshot.workers] == ["w-ok"]
    dead = await q.recovery.expired(("worker",))
    assert dead == {"worker": ["w-bad"]}
    assert await q.redis.exists(q.keys.heartbeat("worker", "w-bad")) == 0


def test_a_batch_with_an_unreadable_envelope_keeps_the_readable_ones() -> None:
    good = env(1, "paid")
    data = wire.encode_batch("b", "d", 1, [good, b'{"id": "half"}'])
    batch, unreadable = wire.decode_batch(data)
    assert [e.id for e in batch.envelopes] == ["r1"]
    assert unreadable == 1
    assert wire.decode_batch(wire.retried_batch(data))[0].attempt == 1


async def test_take_refuses_for_a_credit_whose_worker_has_gone(q: Faces) -> None:
    await q.gateway.enqueue("paid", env(1, "paid"))
    await q.redis.rpush(q.keys.credits("d1"), "w-gone")
    taken = await q.dispatcher.take("w-gone", "b1", clock.now_ms(), rule(10))
    assert taken.worker_gone
    assert taken.envelopes == []
    assert await queued(q.store, "paid") == 1


async def test_jobs_come_after_synchronous_work_and_alone_only_with_headroom(q: Faces) -> None:
    now = clock.now_ms()

    def job(i: int, tier: str) -> wire.Envelope:
        return wire.Envelope(f"j{i}", "gw", tier, "k", f"job{i}", now, now + 60_000, job=True)

    for i, tier in enumerate(["free", "enterprise"]):
        assert await q.gateway.enqueue_job(job(i, tier), max_queued=10, result_ttl_ms=60_000)
    assert not await q.gateway.enqueue_job(job(9, "free"), max_queued=2, result_ttl_ms=60_000)
    await q.gateway.enqueue("free", env(1, "free"))
    # Synchronous work first, then jobs (by tier) in the slots it leaves.
    mixed = await take(q, 10, now=now, jobs_headroom=1)
    assert ids(mixed.envelopes) == ["r1", "j1", "j0"]
    assert mixed.jobs == 2
    assert (await q.gateway.job("j1"))["status"] == "running"
    assert await q.redis.hget(q.keys.jobs_queued, "k") is None  # both left their queue
    # A batch of jobs alone: only with another worker idle (or after a quiet spell).
    await q.gateway.enqueue_job(job(3, "paid"), max_queued=10, result_ttl_ms=60_000)
    await q.redis.set(q.keys.last_dispatch, now)
    alone = await take(q, 10, now=now, jobs_headroom=1)
    assert alone.envelopes == []
    await q.redis.lpush(q.keys.ready, "w2")
    alone = await take(q, 10, now=now, jobs_headroom=1)
    assert ids(alone.envelopes) == ["j3"]
    # A batch of jobs only does not count for pacing.
    assert await q.redis.get(q.keys.last_dispatch) == str(now).encode()
    assert (await q.gateway.job("j3"))["status"] == "running"
    # A dispatcher of an earlier version that died with a job in its inflight
    # list gives it back, queued again.
    raw = wire.encode(job(4, "paid"))
    await q.redis.hset(q.keys.job("j4"), mapping={"status": "running", "key_id": "k"})
    await q.redis.rpush(q.keys.inflight("d1"), raw)
    await q.dispatcher.requeue_own()
    assert (await q.gateway.job("j4"))["status"] == "queued"
    assert await q.redis.llen(q.keys.job_queue("paid")) == 1
    assert await q.redis.hget(q.keys.jobs_queued, "k") == b"1"


# -- admit: quota and enqueue in one step, many requests in one write ---------


async def test_concurrent_admits_share_writes_and_each_gets_its_own_reply(q: Faces) -> None:
    counter = Counter(q.gateway.counter_key("c"), 1, 30, 60)
    replies = await asyncio.gather(
        *(q.gateway.admit([counter], "free", env(i, "free")) for i in range(50))
    )
    assert sum(r.admitted for r in replies) == 30
    # Each was charged in the order Redis ran it: counts 1..30, refused ones see 30.
    assert sorted(r.counts[0] for r in replies if r.admitted) == list(range(1, 31))
    assert all(r.counts[0] == 30 and not r.queued for r in replies if not r.admitted)
    assert await queued(q.store, "free") == 30
    assert await charged(q, counter.key) == 30
    assert 60 < await q.redis.ttl(counter.key) <= 67  # a window and a tenth, and a second


async def test_admit_reloads_its_script_after_redis_forgot_it(q: Faces) -> None:
    await q.redis.script_flush()  # as a restarted or failed-over Redis would have
    replies = await asyncio.gather(*(q.gateway.admit([], "paid", env(i, "paid")) for i in range(5)))
    assert [r.admitted for r in replies] == [True] * 5
    assert await queued(q.store, "paid") == 5


async def test_a_failing_call_fails_alone_and_a_lost_redis_fails_every_call(q: Faces) -> None:
    good = Counter(q.gateway.counter_key("g"), 1, 10, 60)
    # A cost that is not a number makes the script fail: that call's error only.
    bad = Counter(q.gateway.counter_key("b"), "x", 10, 60)  # type: ignore[arg-type]
    results = await asyncio.gather(
        q.gateway.admit([good]),
        q.gateway.admit([bad]),
        q.gateway.admit([good]),
        return_exceptions=True,
    )
    assert [type(r).__name__ for r in results] == ["Admitted", "ResponseError", "Admitted"]
    assert await charged(q, good.key) == 2


async def test_every_queued_call_fails_with_a_store_error_when_redis_is_gone() -> None:
    async with own_redis() as (server, _, gateway):
        server.stop()
        async with asyncio.timeout(10):  # failing, not hanging
            results = await asyncio.gather(
                *(gateway.admit([], "free", env(i, "free")) for i in range(5)),
                return_exceptions=True,
            )
        assert all(isinstance(r, STORE_ERRORS) for r in results), results


async def test_a_lone_request_is_handed_straight_to_an_idle_worker(q: Faces) -> None:
    """Nothing queued, an idle worker's credit on ready, pacing not holding:
    the admit forms the batch itself (what a dispatcher's take would form)
    and spends the credit. Anything else queues it as before."""
    counter = Counter(q.gateway.counter_key("k"), 1, 100, 60)
    await q.dispatcher.publish_rule(rule(10, interval_ms=50))

    async def admit(i: int, tier: str = "paid") -> bool:
        admitted = await q.gateway.admit([counter], tier, env(i, tier), straight=True)
        assert admitted.admitted
        return admitted.handed

    await q.worker.offer_credit()  # w1: alive (the fixture's heartbeat)
    before = await q.stats()
    assert await admit(1)
    assert await q.redis.llen(q.keys.ready) == 0  # the credit paid for it
    # (to w1's own hand-off list: the worker whose credit paid runs it)
    handed = await q.redis.rpop(q.keys.handoff("w1"))
    assert handed.startswith(wire.BATCH_FRAME)  # (framed as a take frames one)
    batch, unreadable = wire.decode_batch(handed)
    assert ([e.id for e in batch.envelopes], batch.dispatcher, unreadable) == (["r1"], "gw", 0)
    after = await q.stats()
    assert after["batches_formed"] == before.get("batches_formed", 0) + 1
    assert int(await q.redis.get(q.keys.last_dispatch)) >= batch.formed_ms
    assert await charged(q, counter.key) == 1  # charged all the same

    # Pacing: a hand-off 50 ms ago at most holds the next one (queued, the doorbell rung).
    await q.worker.offer_credit()
    assert not await admit(2)
    assert await queued(q.store, "paid") == 1
    assert await q.redis.llen(q.keys.doorbell) == 1
    await q.redis.delete(q.keys.last_dispatch, q.keys.doorbell)
    # Anything queued ahead (here r2, of any tier; or jobs) keeps it in line.
    assert not await admit(3, "enterprise")
    assert await q.redis.llen(q.keys.ready) == 1
    await q.redis.delete(*q.keys.queues, *q.keys.fair_queues, *q.keys.fair_states)
    await q.redis.lpush(q.keys.job_queue("free"), b"a job")
    assert not await admit(4)
    await q.redis.delete(
        *q.keys.queues, *q.keys.fair_queues, *q.keys.fair_states, *q.keys.job_queues
    )
    await q.redis.zadd(q.keys.job_fair_queue("free"), {b"a fair job": 0})
    assert not await admit(4)
    await q.redis.delete(*q.keys.queues, *q.keys.fair_queues, *q.keys.fair_states)
    await q.redis.delete(*q.keys.job_fair_queues)
    # A credit whose worker's heartbeat is gone is dropped, not paid with.
    await q.redis.lpush(q.keys.ready, b"gone")
    await q.redis.rpoplpush(q.keys.ready, q.keys.ready)  # "gone" first in line
    assert await q.redis.lrange(q.keys.ready, -1, -1) == [b"gone"]
    assert await admit(5)
    assert await q.redis.llen(q.keys.ready) == 0
    assert await q.redis.llen(q.keys.handoff("w1")) == 1
    # No rule published (or an unreadable one): queued.
    await q.worker.offer_credit()
    await q.redis.set(q.keys.batch_rule, b"not json")
    assert not await admit(6)
    # A key of another type on its way (Redis contents are not trusted): queued.
    await q.dispatcher.publish_rule(rule(10))
    await q.redis.delete(
        *q.keys.queues, *q.keys.fair_queues, *q.keys.fair_states, q.keys.handoff("w1")
    )
    await q.redis.set(q.keys.handoff("w1"), b"a string")
    assert not await admit(8)
    assert await queued(q.store, "paid") == 1
    assert await q.redis.llen(q.keys.ready) == 1  # not spent
    await q.redis.delete(
        q.keys.handoff("w1"), *q.keys.queues, *q.keys.fair_queues, *q.keys.fair_states
    )
    stats = await q.redis.hgetall(q.keys.stats)
    await q.redis.delete(q.keys.stats)
    await q.redis.set(q.keys.stats, b"a string")
    assert not await admit(9)  # queued once, never also handed
    assert await queued(q.store, "paid") == 1
    assert await q.redis.llen(q.keys.handoff("w1")) == 0
    assert await q.redis.llen(q.keys.ready) == 1
    await q.redis.delete(q.keys.stats)
    await q.redis.hset(q.keys.stats, mapping=stats)
    await q.redis.lpush(q.keys.handoff("w1"), b"r5's batch")
    # Refused by its quota: nothing formed, the credit kept.
    await q.redis.delete(*q.keys.queues, *q.keys.fair_queues, *q.keys.fair_states)
    await q.dispatcher.publish_rule(rule(10))
    await q.gateway.admit([counter._replace(cost=100 - await charged(q, counter.key))])
    refused = await q.gateway.admit([counter], "paid", env(7, "paid"), straight=True)
    assert (refused.admitted, refused.handed) == (False, False)
    assert await q.redis.llen(q.keys.ready) == 1
    assert await q.redis.llen(q.keys.handoff("w1")) == 1


async def test_a_transaction_on_the_held_connection_beside_script_calls(q: Faces) -> None:
    """A worker's answer goes out as one MULTI/EXEC on the held connection,
    written together with other calls: each caller gets its own replies; a
    command that fails fails its transaction's caller, after the others in
    it ran (as EXEC runs them), and nothing else."""
    pipelined = q.store.pipelined
    fine = [("SET", "t:a", "1"), ("SET", "t:b", "2")]
    failing = [("SET", "t:c", "3"), ("LPUSH", "t:c", "x"), ("SET", "t:d", "4")]
    results = await asyncio.gather(
        q.gateway.admit([], "free", env(1, "free")),
        pipelined.transaction(fine, ()),
        pipelined.transaction(failing, ()),
        q.gateway.admit([], "free", env(2, "free")),
        return_exceptions=True,
    )
    assert [type(r).__name__ for r in results] == ["Admitted", "list", "ResponseError", "Admitted"]
    assert results[1] == [b"OK", b"OK"]
    assert "WRONGTYPE" in str(results[2])
    assert await q.redis.mget("t:a", "t:b", "t:c", "t:d") == [b"1", b"2", b"3", b"4"]
    assert await queued(q.store, "free") == 2


async def test_a_job_record_of_another_type_reads_as_no_job(q: Faces) -> None:
    """A key planted under a job's name is no job: reading or cancelling it
    finds none (404), not an error that says Redis is unreachable."""
    await q.redis.set(q.keys.job("j-string"), b"planted")
    assert await q.gateway.job("j-string") == {}
    assert await q.gateway.cancel_job("j-string", "k") is None
    assert await q.redis.get(q.keys.job("j-string")) == b"planted"


async def test_a_job_record_of_another_type_does_not_block_the_answer(q: Faces) -> None:
    """finish_jobs runs in the transaction that answers a batch: a record
    that is not a job's hash (or whose result ttl is not a number) must
    not fail that answer, which would be retried for ever."""
    await q.redis.lpush(q.keys.processing("w1"), b"the batch")
    await q.redis.set(q.keys.job("j-string"), b"planted")
    await q.redis.hset(q.keys.job("j-bad-ttl"), mapping={"status": "running", "result_ttl_ms": "x"})
    await q.redis.hset(q.keys.job("j-fine"), mapping={"status": "running", "result_ttl_ms": 5000})
    results = [
        wire.Result(i, "b1", 3, "w1", 0, 100, output="out")
        for i in ("j-string", "j-bad-ttl", "j-fine")
    ]
    reply = wire.Reply(results)
    async with asyncio.timeout(5):
        await q.worker.answer_batch({wire.JOBS: reply}, clock.now_ms(), b"the batch")
    assert await q.redis.llen(q.keys.processing("w1")) == 0
    assert await q.redis.get(q.keys.job("j-string")) == b"planted"
    assert await q.redis.hget(q.keys.job("j-bad-ttl"), "status") == b"succeeded"
    assert 0 < await q.redis.pttl(q.keys.job("j-bad-ttl")) <= 600_000
    assert 0 < await q.redis.pttl(q.keys.job("j-fine")) <= 5000


async def test_a_final_job_status_never_changes(q: Faces) -> None:
    """A job the reaper failed (its worker looked dead), then answered by
    that worker after all: the first final status stays, since a client may
    have read it."""
    await q.redis.hset(q.keys.job("j-failed"), mapping={"status": "failed", "result": "first"})
    await q.redis.hset(q.keys.job("j-running"), mapping={"status": "running"})
    await q.redis.lpush(q.keys.processing("w1"), b"the batch")
    results = [
        wire.Result(i, "b1", 2, "w1", 0, 100, output="out") for i in ("j-failed", "j-running")
    ]
    await q.worker.answer_batch({wire.JOBS: wire.Reply(results)}, clock.now_ms(), b"the batch")
    assert await q.redis.hmget(q.keys.job("j-failed"), "status", "result") == [b"failed", b"first"]
    assert await q.redis.hget(q.keys.job("j-running"), "status") == b"succeeded"


async def test_a_worker_takes_and_acks_after_redis_forgot_the_scripts(q: Faces) -> None:
    await q.redis.lpush(q.keys.processing("w1"), b"the batch")
    await q.redis.script_flush()  # as a restarted or failed-over Redis would have
    reply = wire.Reply([wire.Result("r1", "b1", 1, "w1", 0, 100, output="out")])
    assert (await q.worker.take_next(b"the batch", "s", clock.now_ms())).batch is None
    assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]
    await q.worker.answer_batch({"gw": reply}, clock.now_ms(), b"the batch")
    assert await q.redis.llen(q.keys.processing("w1")) == 0
    # A small batch answered with the take, the scripts forgotten again: the
    # whole transaction runs again once they are loaded (its replies may go
    # out twice, which gateways ignore), and the batch is taken off processing.
    await q.redis.lpush(q.keys.processing("w1"), b"the small batch")
    await q.redis.script_flush()
    taken = await q.worker.take_next(b"the small batch", "s2", clock.now_ms(), {"gw": reply})
    assert taken.batch is None
    assert await q.redis.llen(q.keys.processing("w1")) == 0
    # A leaving worker's ack is a script too.
    await q.redis.script_flush()
    await q.redis.lpush(q.keys.processing("w1"), b"the next batch")
    await q.worker.answer_batch({"gw": reply}, clock.now_ms(), b"the next batch", leaving=True)
    assert await q.redis.llen(q.keys.processing("w1")) == 0
    assert await q.redis.llen(q.keys.ready) == 0


async def _take(q: Faces, ran: bytes, step: str = "step 1") -> TakeResult:
    return await q.worker.take_next(ran, step, clock.now_ms())


async def test_a_free_worker_forms_its_next_batch_by_the_published_rule_and_can_repeat(
    q: Faces,
) -> None:
    """A worker whose backend has returned forms its next batch in one
    step, in priority order, straight into its processing list beside the
    batch just run; no credit goes out. Run twice (its reply lost), it gives
    the same batch back and takes nothing more."""
    await q.dispatcher.publish_rule(rule(2))
    await q.redis.lpush(q.keys.processing("w1"), b"batch A")
    for i, tier in enumerate(["free", "enterprise", "paid"]):
        await q.gateway.enqueue(tier, env(i, tier))
    first = await _take(q, b"batch A")
    again = await _take(q, b"batch A")
    assert first.batch is not None
    assert first.batch == again.batch
    assert (first.size, again.size) == (2, 0)
    batch, _ = wire.decode_batch(first.batch)
    assert [e.id for e in batch.envelopes] == ["r1", "r2"]
    assert batch.dispatcher == "w1"  # formed by the worker itself
    assert await q.redis.lrange(q.keys.processing("w1"), 0, -1) == [first.batch, b"batch A"]
    assert await q.redis.llen(q.keys.ready) == 0
    assert await queued(q.store, "free") == 1
    assert await q.redis.llen(q.keys.doorbell) == 1  # work left behind, for idle workers
    assert (await q.stats())["requests_batched"] == 2


async def test_a_small_batch_is_answered_in_the_step_that_takes_the_next(q: Faces) -> None:
    """Its replies go out with the take, after it (the next batch is formed
    from what was queued before), and the batch leaves processing; run
    twice, the same next batch comes back and no second one is formed."""
    await q.dispatcher.publish_rule(rule(10))
    await q.redis.lpush(q.keys.processing("w1"), b"batch A")
    await q.gateway.enqueue("paid", env(1, "paid"))
    pubsub = q.redis.pubsub()
    await pubsub.subscribe(q.keys.reply_channel("gw"))
    reply = wire.Reply([wire.Result("r0", "bA", 1, "w1", 0, 100, output="out")])
    first = await q.worker.take_next(b"batch A", "s", clock.now_ms(), {"gw": reply})
    again = await q.worker.take_next(b"batch A", "s", clock.now_ms(), {"gw": reply})
    assert first.batch is not None
    assert (first.batch, first.size, again.size) == (again.batch, 1, 0)
    assert await q.redis.lrange(q.keys.processing("w1"), 0, -1) == [first.batch]
    assert await q.redis.llen(q.keys.ready) == 0
    results = []
    for _ in range(20):
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            results.extend(r.id for r in wire.decode_reply(message["data"]).results)
        if len(results) == 2:
            break
    await pubsub.aclose()
    assert results == ["r0", "r0"]  # the repeat publishes again; the gateway ignores it


async def test_a_small_batch_is_acked_even_beside_a_batch_left_in_processing(q: Faces) -> None:
    """A stale batch in processing (a Redis restored from disk) is run
    next, and the small batch just answered leaves: the two never alternate."""
    await q.dispatcher.publish_rule(rule(10))
    await q.redis.lpush(q.keys.processing("w1"), b"stale", b"small")
    reply = wire.Reply([wire.Result("r0", "b", 1, "w1", 0, 100, output="out")])
    taken = await q.worker.take_next(b"small", "s", clock.now_ms(), {"gw": reply})
    assert taken.batch == b"stale"
    assert await q.redis.lrange(q.keys.processing("w1"), 0, -1) == [b"stale"]
    # Then the stale one is run and answered like any other.
    taken = await q.worker.take_next(b"stale", "s2", clock.now_ms(), {"gw": reply})
    assert taken.batch is None
    assert await q.redis.llen(q.keys.processing("w1")) == 0
    assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]


async def test_a_free_worker_runs_a_waiting_batch_first_and_offers_no_credit(q: Faces) -> None:
    """A batch already on the batches list (one the reaper retried) goes
    first. No credit is offered for it: one would let a dispatcher form a
    batch ahead of every worker, again and again."""
    await q.dispatcher.publish_rule(rule(10))
    await q.redis.lpush(q.keys.processing("w1"), b"batch A")
    await q.redis.lpush(q.keys.batches, b"batch B", b"batch C")  # B is the oldest
    await q.gateway.enqueue("enterprise", env(1, "enterprise"))
    first = await _take(q, b"batch A")
    again = await _take(q, b"batch A")
    assert first.batch == again.batch == b"batch B"
    assert await q.redis.lrange(q.keys.batches, 0, -1) == [b"batch C"]
    assert await q.redis.llen(q.keys.ready) == 0
    assert await queued(q.store, "enterprise") == 1
    assert not first.credit_lost


async def test_a_take_whose_batch_is_gone_says_so_and_puts_out_no_credit(q: Faces) -> None:
    """The reaper took the batch (or it was dead-lettered): nothing in hand,
    and the step cannot tell whether the credit is out, so it says so."""
    await q.dispatcher.publish_rule(rule(10))
    await q.gateway.enqueue("free", env(1, "free"))
    gone = await _take(q, b"batch A")
    assert gone.credit_lost
    assert gone.batch is None
    assert await q.redis.llen(q.keys.ready) == 0
    assert await queued(q.store, "free") == 1
    assert await q.worker.ensure_credit()  # what the worker does then
    assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]


async def test_a_free_worker_offers_its_credit_with_no_rule_a_bad_rule_or_pacing(q: Faces) -> None:
    await q.gateway.enqueue("paid", env(1, "paid"))
    now = clock.now_ms()
    await q.redis.set(q.keys.last_dispatch, now)
    pacing = msgspec.json.encode(rule(10, interval_ms=60_000))
    unreadable = [
        b"junk",
        b'{"n": 1000, "interval_ms": 0, "headroom": 0, "quiet_ms": 0, "min_slots": [0, 0, 0]}',
        b'{"n": 5}',
        pacing,
    ]
    for i, published in enumerate([None, *unreadable]):
        if published is not None:
            await q.redis.set(q.keys.batch_rule, published)
        await q.redis.delete(q.keys.doorbell)
        await q.redis.lpush(q.keys.processing("w1"), b"batch A")
        answered = await _take(q, b"batch A", f"step {i}")
        assert answered.batch is None, published
        assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]  # once, never twice
        # Work still waits: the doorbell wakes a dispatcher that holds no credit.
        assert await q.redis.lrange(q.keys.doorbell, 0, -1) == [b"1"], published
        assert await queued(q.store, "paid") == 1
        assert await q.redis.lrange(q.keys.processing("w1"), 0, -1) == [b"batch A"]
        await q.redis.delete(q.keys.processing("w1"))  # answered
    # A rule key of another type is no rule either (not a failed step).
    await q.redis.delete(q.keys.batch_rule)
    await q.redis.rpush(q.keys.batch_rule, "x")
    await q.redis.lpush(q.keys.processing("w1"), b"batch A")
    assert (await _take(q, b"batch A")).batch is None
    assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]


async def test_a_worker_drops_what_expired_or_was_cancelled_as_it_forms(q: Faces) -> None:
    await q.dispatcher.publish_rule(rule(10))
    await q.gateway.enqueue("free", env(1, "free", deadline_in_ms=-1))
    await q.gateway.enqueue("free", env(2, "free"))
    await q.gateway.enqueue("free", env(3, "free"))
    await q.gateway.cancel("r2", clock.now_ms() + 60_000)
    await q.redis.lpush(q.keys.processing("w1"), b"batch A")
    answered = await _take(q, b"batch A")
    assert (answered.size, answered.expired, answered.cancelled) == (1, 1, 1)
    assert answered.batch is not None
    assert [e.id for e in wire.decode_batch(answered.batch)[0].envelopes] == ["r3"]


async def test_a_leaving_worker_acks_and_takes_its_credit_back(q: Faces) -> None:
    await q.dispatcher.publish_rule(rule(10))
    await q.gateway.enqueue("free", env(1, "free"))
    await q.worker.offer_credit()
    await q.redis.lpush(q.keys.processing("w1"), b"batch A")
    reply = wire.Reply([wire.Result("r", "b", 1, "w1", 0, 100, output="out")])
    await q.worker.answer_batch({"gw": reply}, clock.now_ms(), b"batch A", leaving=True)
    assert await q.redis.llen(q.keys.processing("w1")) == 0
    assert await q.redis.llen(q.keys.ready) == 0
    assert await queued(q.store, "free") == 1


async def test_admit_starts_over_from_windows_it_cannot_trust(q: Faces) -> None:
    """Redis contents are not trusted: a window that is text, of another type,
    a hash whose sum or newest bucket is no number, one without its newest
    bucket, or one ahead of Redis's clock starts over; none blocks a key."""
    names = ("text", "list", "sum", "newest", "missing", "ahead", "full")
    keys = [q.gateway.counter_key(name) for name in names]
    now_s = (await q.redis.time())[0]
    current = now_s * 10 // 60  # the bucket a 60 s window is in now
    await q.redis.set(keys[0], "abc")
    await q.redis.rpush(keys[1], "x")
    await q.redis.hset(keys[2], mapping={"l": current, "s": "0x10", str(current): 5})
    await q.redis.hset(keys[3], mapping={"l": "soon", "s": 5, str(current): 5})
    await q.redis.hset(keys[4], mapping={"s": 5, str(current): 5})
    await q.redis.hset(keys[5], mapping={"l": current + 100, "s": 10, str(current + 100): 10})
    counters = [Counter(k, 1, 5, 60) for k in keys[:6]]
    admitted = await q.gateway.admit(counters, "free", env(1, "free"))
    assert admitted.admitted
    assert admitted.counts == [1] * 6
    assert all([await charged(q, k) == 1 for k in keys[:6]])
    assert all([0 < await q.redis.ttl(k) <= 67 for k in keys[:6]])
    # A window at its limit, planted without a TTL: refused, until its
    # bucket leaves the window (it is no longer counted then, and deleted).
    await q.redis.hset(keys[6], mapping={"l": current, "s": 5, str(current): 5})
    refused = await q.gateway.admit([Counter(keys[6], 1, 5, 60)])
    assert not refused.admitted
    assert 0 < refused.ttls_ms[0] <= 66_000


async def test_a_window_planted_far_below_nothing_starts_over(q: Faces) -> None:
    """A window's sum below minus the most it may hold cannot be one of
    refunds (they take back only charges made): planted, it starts over
    (before, a sum of -100,000 let a key of 100 a minute past it without
    end). A sum a little below nothing, as a late refund leaves, is kept;
    a budget's below nothing at all starts over."""
    now_s = (await q.redis.time())[0]
    current = now_s * 10 // 60
    planted, refunded = q.gateway.counter_key("planted"), q.gateway.counter_key("refunded")
    await q.redis.hset(planted, mapping={"l": current, "s": -100_000, str(current): -100_000})
    await q.redis.hset(refunded, mapping={"l": current, "s": -2, str(current): -2})
    for _ in range(5):
        assert (await q.gateway.admit([Counter(planted, 1, 5, 60)])).admitted
        assert (await q.gateway.admit([Counter(refunded, 1, 5, 60)])).admitted
    assert not (await q.gateway.admit([Counter(planted, 1, 5, 60)])).admitted
    assert await charged(q, planted) == 5
    assert await charged(q, refunded) == 3  # (-2, then five)
    assert (await q.gateway.admit([Counter(refunded, 1, 5, 60)])).admitted
    # A budget's sum is never below nothing (its give-backs stop there).
    budget = q.gateway.counter_key("budget/k/gpu_us/day")
    day = str(now_s // 86_400)
    await q.redis.hset(budget, mapping={"l": day, "s": -100_000, day: -100_000})
    spend = Counter(budget, 600, 1000, 0, True, "day")
    assert (await q.gateway.admit([spend])).admitted
    assert not (await q.gateway.admit([spend])).admitted


@pytest.mark.parametrize("model", ["default", "large"])
def test_the_names_admit_lua_gives_the_keys_it_hands_off_with_are_keys_names(model: str) -> None:
    """admit.lua names the keys of a straight hand-off from the model's
    prefix (they are not sent with every request): each name it writes is
    the one Keys gives."""
    keys = Keys("ns").of_model(model)
    source = scripts.source("admit")
    named = {
        "ready": keys.ready,
        "batch-rule": keys.batch_rule,
        "last-dispatch": keys.last_dispatch,
        "stats": keys.stats,
        "hb:worker:": keys.heartbeat("worker", ""),
        "batches:": keys.handoff(""),
    }
    for tier in TIERS:
        named |= {
            f"queue:{tier}": keys.queue(tier),
            f"jobs:{tier}": keys.job_queue(tier),
            f"fq:{tier}": keys.fair_queue(tier),
            f"jfq:{tier}": keys.job_fair_queue(tier),
        }
    for suffix, name in named.items():
        assert name == keys.prefix + suffix
        kind = suffix.split(":")[0] + ":" if suffix.split(":")[-1] in TIERS else suffix
        assert f"'{kind}'" in source, kind


async def test_a_planted_doorbell_goes_and_the_request_is_queued_and_rung(q: Faces) -> None:
    """A doorbell of another type is no doorbell: the admit replaces it (it
    is not a failed step after the request was charged and queued)."""
    await q.redis.set(q.keys.doorbell, "planted")
    admitted = await q.gateway.admit([], "free", env(1, "free"))
    assert admitted.queued
    assert await q.redis.lrange(q.keys.doorbell, 0, -1) == [b"1"]
    # Rung once, however many wait.
    await q.gateway.admit([], "free", env(2, "free"))
    assert await q.redis.llen(q.keys.doorbell) == 1


async def test_a_heartbeat_of_another_type_reads_as_expired(q: Faces) -> None:
    now = clock.now_ms()
    await q.store.beat(wire.Heartbeat("worker", "w-ok", now, now, batch_ms=100.0), 5_000)
    await q.redis.sadd(q.keys.members("worker"), "w-hash")
    await q.redis.hset(q.keys.heartbeat("worker", "w-hash"), "a", "b")
    snapshot = await q.store.fleet_snapshot(now)
    assert [w.id for w in snapshot.workers] == ["w-ok"]


async def test_a_members_set_of_another_type_is_none_and_goes(q: Faces) -> None:
    """A planted members set blinds no gateway (before, every fleet read
    failed: 503 for every request) and no beat: it goes, and the next beat
    registers its process again."""
    now = clock.now_ms()
    await q.redis.set(q.keys.members("worker"), "planted")
    assert (await q.store.fleet_snapshot(now)).workers == []
    await q.store.beat(wire.Heartbeat("worker", "w-ok", now, now, batch_ms=100.0), 5_000)
    assert [w.id for w in (await q.store.fleet_snapshot(now)).workers] == ["w-ok"]


async def test_a_step_token_of_another_type_is_no_token(q: Faces) -> None:
    """Redis contents are not trusted: a planted key does not wedge the worker."""
    await q.redis.rpush(q.keys.last_step("w1"), "x")
    await q.redis.lpush(q.keys.processing("w1"), b"batch A")
    assert (await _take(q, b"batch A")).batch is None
    assert await q.redis.lrange(q.keys.ready, 0, -1) == [b"w1"]
    assert await q.redis.get(q.keys.last_step("w1")) == b"step 1"


async def test_a_take_run_twice_offers_one_credit(q: Faces) -> None:
    await q.redis.lpush(q.keys.processing("w1"), b"batch A")
    await _take(q, b"batch A")  # nothing queued: the credit goes out
    assert await q.dispatcher.wait_credit(1) == "w1"  # a dispatcher holds it now
    # The reply to that step was lost: the worker runs it again.
    await _take(q, b"batch A")
    assert await q.redis.llen(q.keys.ready) == 0  # no second credit beside the held one


async def test_pipelined_calls_fail_when_redis_hangs_and_go_on_once_it_answers() -> None:
    """A Redis that stops answering (here: SIGSTOP) fails the calls in flight
    at the client's socket timeout, not never; once it answers again, the
    next call goes out on a fresh connection."""
    async with own_redis() as (server, _, gateway):
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            async with asyncio.timeout(10):
                results = await asyncio.gather(
                    *(gateway.admit([], "free", env(i, "free")) for i in range(3)),
                    return_exceptions=True,
                )
            assert all(isinstance(r, STORE_ERRORS) for r in results), results
            assert time.monotonic() - started < 6
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        async with asyncio.timeout(10):
            assert (await gateway.admit([], "free", env(9, "free"))).admitted


async def test_pipelined_calls_go_on_after_redis_restarts_without_a_failed_call() -> None:
    """The held connection died with the old Redis: the next call notices it
    before writing, opens a new one, and reloads the script Redis forgot."""
    async with own_redis() as (server, store, gateway):
        server.stop()
        server.start()
        async with asyncio.timeout(10):
            while True:  # until the old connection's end has been seen
                link = store.pipelined._link
                if link is None or not link.usable():
                    break
                await asyncio.sleep(0.01)
            assert (await gateway.admit([], "free", env(2, "free"))).admitted


@contextlib.asynccontextmanager
async def own_redis() -> AsyncIterator[tuple[RedisServer, Store, GatewayQueue]]:
    """A Redis of the test's own (it stops, hangs or restarts it), a store on
    it, and a gateway that has made one call already."""
    server = RedisServer().start()
    store = Store.connect(server.url, "t", name="test")
    try:
        gateway = GatewayQueue(store, "gw")
        assert (await gateway.admit([], "free", env(1, "free"))).admitted
        yield server, store, gateway
    finally:
        await store.close()
        server.close()


async def test_a_take_that_read_its_clock_before_a_job_came_does_not_start_it_late(
    q: Faces,
) -> None:
    """A take's ``now`` is read before its call reaches Redis: a job
    enqueued in between, with a deadline already past when the script
    runs, is expired there (judged on Redis's clock), never started."""
    now = clock.now_ms()
    stale = now - 20  # the take read its clock...
    created = now - 10  # ...then a job with timeout_ms 1 arrived...
    job = wire.Envelope("j1", "gw", "paid", "k", "in", created, created + 1, job=True)
    assert await q.gateway.enqueue_job(job, max_queued=10, result_ttl_ms=60_000)
    taken = await take(q, 10, now=stale, jobs_headroom=0)  # ...and the script runs now
    record = await q.gateway.job("j1")
    assert taken.envelopes == []
    assert record["status"] == "expired"
    assert int(record["started_ms"]) >= int(record["deadline_ms"])


async def test_the_worker_whose_credit_paid_runs_the_batch(q: Faces) -> None:
    """Two idle workers, a dispatcher holding w1's credit, w2's on ready; a
    lone request is handed straight with w2's credit. w1 has waited
    longest, yet w2 runs it: a worker that ran a batch paid with another's
    credit would offer its own a second time (two credits out, batches
    formed ahead of any free worker) and leave the payer with none
    (``worker.credit_restored``, which said Redis had lost it)."""
    r, keys = q.redis, q.keys
    await r.set(keys.heartbeat("worker", "w2"), b"{}")
    await r.sadd(keys.members("dispatcher"), "d1")
    await q.dispatcher.publish_rule(rule(10))
    w2 = WorkerQueue(q.store, "w2")
    await q.worker.offer_credit()
    await w2.offer_credit()  # ready: [w2, w1]
    assert await q.dispatcher.wait_credit(1) == "w1"  # held while d1 waits for work
    pull1 = asyncio.create_task(q.worker.pull_batch(1.0))
    await _blocked(q, 1)  # w1 blocks first
    pull2 = asyncio.create_task(w2.pull_batch(2.0))
    await _blocked(q, 2)
    now = clock.now_ms()
    envelope = wire.encode(wire.Envelope("r1", "gw", "paid", "k", "hi", now, now + 10_000))
    assert (await q.gateway.admit([], "paid", envelope, straight=True)).handed
    ran = await pull2
    assert ran is not None
    assert await pull1 is None
    assert (await w2.take_next(ran, "s1", clock.now_ms())).batch is None  # nothing queued: offered
    ready = await r.lrange(keys.ready, 0, -1)
    held = await r.lrange(keys.credits("d1"), 0, -1)
    assert sorted(ready + held) == [b"w1", b"w2"]  # one credit each, no more
    assert not await q.worker.ensure_credit()
    assert not await w2.ensure_credit()


async def test_a_batch_handed_to_a_worker_that_leaves_or_dies_goes_to_another(
    q: Faces,
) -> None:
    """What waits on a worker's hand-off list when it leaves (or the reaper
    finds it dead) goes to the shared list, where any worker pulls it."""
    r, keys = q.redis, q.keys
    await r.lpush(keys.handoff("w1"), b"batch A")
    await q.worker.leave()
    assert not await r.exists(keys.heartbeat("worker", "w1"))
    assert await r.lrange(keys.batches, 0, -1) == [b"batch A"]
    await r.lpush(keys.handoff("w9"), b"batch B")
    assert await q.recovery.recover_worker("w9", max_attempts=2) == []
    # (at the pulling end: a batch handed back has waited already)
    assert await r.lrange(keys.batches, 0, -1) == [b"batch A", b"batch B"]
    await r.set(keys.heartbeat("worker", "w3"), b"{}")
    w3 = WorkerQueue(q.store, "w3")
    await w3.offer_credit()
    assert await w3.pull_batch(1.0) == b"batch B"
    assert await r.lrange(keys.ready, 0, -1) == []  # no credit paid for it: its own went back


async def test_a_retried_batch_goes_to_an_idle_worker_with_its_credit(q: Faces) -> None:
    """The reaper hands a dead worker's batch to a live idle worker, as a
    dispatcher would (that worker's credit pays), so it runs at once; with
    no worker idle it waits on the shared list for the next take."""
    r, keys = q.redis, q.keys
    now = clock.now_ms()
    batch = wire.encode_batch(
        "b9",
        "d1",
        now,
        [wire.encode(wire.Envelope("r1", "gw", "paid", "k", "x", now, now + 9_000))],
    )
    await r.lpush(keys.processing("w9"), batch)
    await r.lpush(keys.ready, "gone")  # a credit whose worker has no heartbeat: dropped
    await q.worker.offer_credit()  # w1: alive, idle
    assert await q.recovery.recover_worker("w9", max_attempts=3) == ["retried"]
    assert await r.lrange(keys.ready, 0, -1) == []
    (handed,) = await r.lrange(keys.handoff("w1"), 0, -1)
    assert wire.decode_batch(handed)[0].attempt == 1
    assert await q.worker.pull_batch(1.0) == handed
    await r.lpush(keys.processing("w9"), batch)
    assert await q.recovery.recover_worker("w9", max_attempts=3) == ["retried"]
    assert await r.llen(keys.batches) == 1  # nobody idle: shared


async def test_everything_handed_to_a_leaving_worker_is_handed_back(q: Faces) -> None:
    r, keys = q.redis, q.keys
    await r.lpush(keys.handoff("w1"), b"one", b"two", b"three")
    await q.worker.leave()
    assert await r.llen(keys.handoff("w1")) == 0
    assert sorted(await r.lrange(keys.batches, 0, -1)) == [b"one", b"three", b"two"]


async def test_a_planted_hand_off_key_takes_nothing_out_of_the_queues(q: Faces) -> None:
    """The hand-off list is written after envelopes leave their queues and a
    script's writes are not undone: a key of another type there is found
    first, and the credit dropped as a gone worker's."""
    await q.gateway.enqueue("paid", env(1, "paid"))
    await q.redis.set(q.keys.handoff("w1"), b"planted")
    taken = await take(q, 10)
    assert (taken.size, taken.worker_gone) == (0, True)
    assert await queued(q.store, "paid") == 1


async def _blocked(q: Faces, clients: int) -> None:
    """Until Redis has this many clients blocked (a pull waiting): 5 s at most."""
    for _ in range(1_000):
        if int((await q.redis.info("clients"))["blocked_clients"]) >= clients:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{clients} pulls never blocked")


async def test_a_window_moves_on_when_its_request_is_refused_by_another(q: Faces) -> None:
    """The buckets that left a window are taken off its sum whenever they
    are found gone, not only when a request is admitted: a key refused by
    another limit (or its share) is not held by charges long out of its window."""
    fast = Counter(q.gateway.counter_key("fast"), 1, 100, 1)
    slow = Counter(q.gateway.counter_key("slow"), 1, 1, 60)
    assert (await q.gateway.admit([fast, slow])).admitted
    start_s = float((await q.redis.time())[0])

    async def past_the_window() -> bool:
        secs, micros = await q.redis.time()
        return secs + micros / 1e6 > start_s + 2.2

    deadline = time.monotonic() + 5
    while not await past_the_window():  # (Redis's clock, the one windows follow)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)  # (the poll's pace; the bound is the deadline above)
    refused = await q.gateway.admit([fast, slow])
    assert (refused.admitted, refused.refused_by) == (False, 1)
    assert await charged(q, fast.key) == 0
    assert refused.counts[0] == 0
