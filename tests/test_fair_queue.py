"""Fair queuing inside a tier (``admit.lua`` queues, ``take_*.lua`` takes), on a
real Redis: the order batches are formed in is checked against a reference
model of start-time fair queuing, written here in a few lines of Python, for
sequences of admissions and takes that hypothesis makes up; and the key's
share of its tier is checked where it refuses."""

import asyncio
import time
from dataclasses import dataclass, field
from typing import cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from infergate.base import clock, wire
from infergate.base.metrics import GatewayMetrics
from infergate.base.queue.dispatcher import DispatcherQueue
from infergate.base.queue.forming import Rule
from infergate.base.queue.gateway import GatewayQueue, Place
from infergate.base.queue.store import Store
from infergate.gateway.shares import Shares
from infergate.policies import KeyEntry
from prometheus_client import CollectorRegistry

from tests.helpers import queued

WEIGHTS = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 0.5}


def envelope(n: int, key: str, tier: str = "paid") -> bytes:
    now = clock.now_ms()
    return wire.encode(wire.Envelope(f"r{n:04}", "gw", tier, key, f"in{n}", now, now + 60_000))


@dataclass
class Reference:
    """Start-time fair queuing as take_*.lua and admit.lua keep it: a request's
    start tag is the later of the tier's virtual time and its key's last
    finish tag; requests leave in (tag, bytes) order; the virtual time is the
    tag of the last one taken; a key with nothing waiting is forgotten (its
    finish tag once the virtual time has reached it), and so is the tier
    once nothing of it waits."""

    virtual: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    queue: list[tuple[float, bytes, str]] = field(default_factory=list)

    def admit(self, key: str, cost: int, data: bytes) -> None:
        start = max(self.virtual, self.finish.get(key, 0.0))
        self.queue.append((start, data, key))
        milli = round(WEIGHTS[key] * 1000)
        self.finish[key] = start + cost * 1000 / max(milli, 1)
        self.waiting[key] = self.waiting.get(key, 0) + 1

    def take(self, n: int) -> list[bytes]:
        self.queue.sort()
        taken, self.queue = self.queue[:n], self.queue[n:]
        if not taken:
            return []
        if not self.queue:
            self.virtual, self.finish, self.waiting = 0.0, {}, {}
        else:
            self.virtual = taken[-1][0]
            for _, _, key in taken:
                self.waiting[key] -= 1
                if self.waiting[key] == 0:
                    del self.waiting[key]
                    if self.finish.get(key, 0.0) <= self.virtual:
                        self.finish.pop(key, None)
        return [data for _, data, _ in taken]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(sorted(WEIGHTS)), st.integers(1, 5000)),
        st.tuples(st.just("take"), st.integers(1, 12), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_batches_follow_the_reference_model_of_fair_queuing(
    redis_url: str, ops: list[tuple[str, str | int, int]]
) -> None:
    asyncio.run(_replay(redis_url, ops))


async def _replay(redis_url: str, ops: list[tuple[str, str | int, int]]) -> None:
    store = Store.connect(redis_url, "fq", name="test")
    try:
        await store.redis.flushdb()
        await store.redis.set(store.keys.heartbeat("worker", "w1"), b"{}")
        gateway, dispatcher = GatewayQueue(store, "gw"), DispatcherQueue(store, "d1")
        model = Reference()
        for i, (op, arg, cost) in enumerate(ops):
            if op == "admit":
                data = envelope(i, str(arg))
                await gateway.enqueue("paid", data, place=Place(str(arg), cost, WEIGHTS[str(arg)]))
                model.admit(str(arg), cost, data)
            else:
                await store.redis.rpush(store.keys.credits("d1"), "w1")
                taken = await dispatcher.take(
                    "w1", f"b{i}", clock.now_ms(), Rule(int(arg), 0, -1, min_slots=(0, 0, 0)), True
                )
                assert taken.envelopes == model.take(int(arg)), i
                await store.redis.delete(store.keys.handoff("w1"))
        # Whatever is left comes out in the model's order too, and leaves nothing.
        await store.redis.rpush(store.keys.credits("d1"), "w1")
        rest = await dispatcher.take(
            "w1", "last", clock.now_ms(), Rule(100, 0, -1, min_slots=(0, 0, 0)), True
        )
        assert rest.envelopes == model.take(100)
        assert not await store.redis.exists(store.keys.fair_state("paid"))
    finally:
        await store.close()


TIERS_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("admit"),
            st.sampled_from(["enterprise", "paid", "free"]),
            st.sampled_from(sorted(WEIGHTS)),
            st.integers(1, 3000),
        ),
        st.tuples(
            st.just("take"),
            st.integers(1, 12),
            st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)),
            st.just(0),
        ),
    ),
    min_size=1,
    max_size=60,
)


def reference_take(models: dict[str, Reference], n: int, slots: tuple[int, ...]) -> list[bytes]:
    """Priority with minimum shares (take_form.lua's formed): each tier
    first its minimum share of the batch, if it has work, then the rest in
    strict priority order, each tier in its own fair order."""
    taken: list[bytes] = []
    tiers = ["enterprise", "paid", "free"]
    for tier, share in zip(tiers, slots, strict=True):
        if share > 0:
            taken += models[tier].take(min(share, n - len(taken)))
    for tier in tiers:
        taken += models[tier].take(n - len(taken))
    return taken


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=TIERS_OPS)
def test_batches_follow_the_reference_model_of_priority_and_minimum_shares(
    redis_url: str, ops: list[tuple]
) -> None:
    asyncio.run(_replay_tiers(redis_url, ops))


async def _replay_tiers(redis_url: str, ops: list[tuple]) -> None:
    store = Store.connect(redis_url, "tiers", name="test")
    try:
        await store.redis.flushdb()
        await store.redis.set(store.keys.heartbeat("worker", "w1"), b"{}")
        gateway, dispatcher = GatewayQueue(store, "gw"), DispatcherQueue(store, "d1")
        models = {tier: Reference() for tier in ("enterprise", "paid", "free")}
        for i, op in enumerate(ops):
            if op[0] == "admit":
                _, tier, key, cost = op
                data = envelope(i, key, tier)
                await gateway.enqueue(tier, data, place=Place(key, cost, WEIGHTS[key]))
                models[tier].admit(key, cost, data)
            else:
                _, n, slots, _ = op
                await store.redis.rpush(store.keys.credits("d1"), "w1")
                rule = Rule(n, 0, -1, min_slots=slots)
                taken = await dispatcher.take("w1", f"b{i}", clock.now_ms(), rule, True)
                assert taken.envelopes == reference_take(models, n, slots), i
                await store.redis.delete(store.keys.handoff("w1"))
    finally:
        await store.close()


@pytest.fixture
async def store(redis_url: str):
    s = Store.connect(redis_url, "fair", name="test")
    await s.redis.set(s.keys.heartbeat("worker", "w1"), b"{}")
    yield s
    await s.close()


async def take_ids(store: Store, n: int) -> list[str]:
    await store.redis.rpush(store.keys.credits("d1"), "w1")
    taken = await DispatcherQueue(store, "d1").take(
        "w1", "b", clock.now_ms(), Rule(n, 0, -1, min_slots=(0, 0, 0)), True
    )
    await store.redis.delete(store.keys.handoff("w1"))
    return [
        wire.decode_envelope(e).key_id + ":" + wire.decode_envelope(e).id for e in taken.envelopes
    ]


async def test_a_key_that_arrives_behind_a_flood_is_served_in_the_next_batch_whole(
    store: Store,
) -> None:
    gateway = GatewayQueue(store, "gw")
    for i in range(100):
        await gateway.enqueue("paid", envelope(i, "a"), place=Place("a", 10))
    for i in range(100, 105):
        await gateway.enqueue("paid", envelope(i, "b"), place=Place("b", 10))
    # Nothing was served before b came: a and b in turn from the start, so
    # b's five are all in the first batch, behind none of a's hundred.
    first = await take_ids(store, 10)
    assert [k.split(":")[0] for k in first] == ["a", "b"] * 5
    second = await take_ids(store, 10)
    assert [k.split(":")[0] for k in second] == ["a"] * 10
    # One more b, after 20 were served: it starts at the tier's virtual time
    # (the last tag taken, not behind a's queue) and goes first in the next batch.
    await gateway.enqueue("paid", envelope(200, "b"), place=Place("b", 10))
    third = await take_ids(store, 10)
    assert [k.split(":")[0] for k in third][:3] == ["b", "a", "a"]
    # Within a key, first come first served.
    a_ids = [k for k in first + second + third if k.startswith("a:")]
    assert a_ids == sorted(a_ids)


async def test_weights_share_the_slots_and_costs_are_charged(store: Store) -> None:
    gateway = GatewayQueue(store, "gw")
    for i in range(60):
        await gateway.enqueue("paid", envelope(i, "heavy"), place=Place("heavy", 10, weight=2.0))
        await gateway.enqueue("paid", envelope(100 + i, "light"), place=Place("light", 10))
        await gateway.enqueue("paid", envelope(200 + i, "long"), place=Place("long", 30))
    counts = {"heavy": 0, "light": 0, "long": 0}
    for _ in range(6):
        for k in await take_ids(store, 10):
            counts[k.split(":")[0]] += 1
    # Weight 2 gets twice a 1's slots; inputs three times as long get a third.
    assert counts == {"heavy": 36, "light": 18, "long": 6}


async def test_a_key_is_refused_past_its_share_of_the_allowance_and_others_are_not(
    store: Store,
) -> None:
    gateway = GatewayQueue(store, "gw")

    async def admit(i: int, key: str, allowance: float, weight: float = 1.0) -> bool:
        place = Place(key, 10, weight, allowance)
        result = await gateway.admit([], "paid", envelope(i, key), place=place)
        assert result.admitted != result.over_share
        return result.admitted

    # Alone, a key may hold the whole allowance.
    assert [await admit(i, "a", 10) for i in range(11)] == [True] * 10 + [False]
    # Another key arrives: it has half (a holds 10 already: over its new share).
    assert [await admit(20 + i, "b", 10) for i in range(6)] == [True] * 5 + [False]
    assert not await admit(30, "a", 10)
    # A heavier key's share: 3 / (1 + 1 + 3) of 10 = 6.
    assert [await admit(40 + i, "c", 10, weight=3.0) for i in range(7)] == [True] * 6 + [False]
    # A share under one request: one while the tier holds less than the
    # allowance (21 + 1 <= 25), never two; none once the tier is full.
    assert await admit(50, "d", 25, weight=0.1)
    assert not await admit(51, "d", 25, weight=0.1)
    assert not await admit(52, "e", 21, weight=0.1)
    # No allowance, no check.
    assert await admit(53, "a", 0)
    assert await queued(store, "paid") == 10 + 5 + 6 + 1 + 1
    # Once its requests are taken, a key has room again.
    await take_ids(store, 30)
    assert await admit(60, "a", 10)


async def test_a_fair_state_that_is_not_a_hash_starts_over(store: Store) -> None:
    """Redis contents are not trusted: a planted state neither breaks nor blocks a tier."""
    gateway = GatewayQueue(store, "gw")
    await store.redis.set(store.keys.fair_state("paid"), "planted")
    assert (await gateway.admit([], "paid", envelope(1, "a"), place=Place("a", 5, 1, 10))).admitted
    await store.redis.hset(
        store.keys.fair_state("paid"), mapping={"v": "x", "n:a": "[]", "w": "{}"}
    )
    assert (await gateway.admit([], "paid", envelope(2, "a"), place=Place("a", 5, 1, 10))).admitted
    assert await take_ids(store, 10) == ["a:r0001", "a:r0002"]
    assert not await store.redis.exists(store.keys.fair_state("paid"))


async def test_keys_seen_lately_share_the_allowance_though_nothing_of_theirs_waits(
    store: Store,
) -> None:
    """A quiet key's requests are taken as they come, so it seldom has any
    waiting; the gateway's keys of the last second count all the same."""
    gateway = GatewayQueue(store, "gw")
    alone = Place("a", 10, 1.0, 10, recent_weight=1.0)
    shared = Place("a", 10, 1.0, 10, recent_weight=2.0)
    admitted = [
        (await gateway.admit([], "paid", envelope(i, "a"), place=shared)).admitted for i in range(6)
    ]
    assert admitted == [True] * 5 + [False]
    assert (await gateway.admit([], "paid", envelope(9, "a"), place=alone)).admitted


def test_the_gateway_remembers_the_keys_of_the_last_second() -> None:
    shares = Shares(
        lambda model, key_id: cast(Store, object()), GatewayMetrics(CollectorRegistry())
    )
    shares.admitted(KeyEntry("a", "paid", "0" * 64, weight=1.0))
    shares.admitted(KeyEntry("b", "paid", "0" * 64, weight=2.0))
    shares.admitted(KeyEntry("c", "free", "0" * 64))
    now = time.monotonic()
    assert shares.recent_weight("paid", lambda: now) == 3.0
    assert shares.recent_weight("free", lambda: now) == 1.0
    assert shares.recent_weight("paid", lambda: now + 0.05) == 3.0  # (at most every 100 ms)
    assert shares.recent_weight("paid", lambda: now + 1.5) == 0.0


async def test_a_state_that_is_stale_or_not_finite_starts_over(store: Store) -> None:
    """Redis contents are not trusted: counts left without their queue (it
    was deleted, or evicted) do not hold a key at its share on an idle tier;
    a virtual time of 'nan' or 'inf' does not fail every admit to the tier."""
    gateway = GatewayQueue(store, "gw")
    state = store.keys.fair_state("paid")
    await store.redis.hset(state, mapping={"n:a": 5, "w:a": 1000, "w": 1000})
    assert (await gateway.admit([], "paid", envelope(1, "a"), place=Place("a", 5, 1, 1))).admitted
    assert await store.redis.hget(state, "n:a") == b"1"
    for planted in ("nan", "inf", "-inf"):
        await store.redis.hset(state, mapping={"v": planted, "f:a": planted, "w": planted})
        data = envelope(2, "a")
        result = await gateway.admit([], "paid", data, place=Place("a", 5, 1, 10))
        assert result.admitted, planted
        await store.redis.zrem(store.keys.fair_queue("paid"), data)
    assert await take_ids(store, 10) == ["a:r0001"]


async def test_a_fair_queue_of_another_type_blinds_nothing_and_stops_nothing(
    store: Store,
) -> None:
    """Redis contents are not trusted: a list planted where a tier's sorted
    set goes neither fails the fleet view (every gateway's, every tier's),
    nor the admits to that tier, nor every batch."""
    gateway = GatewayQueue(store, "gw")
    fq = store.keys.fair_queue("paid")
    await store.redis.rpush(fq, "junk")
    snapshot = await store.fleet_snapshot(0)
    assert snapshot.queue_depth == {"enterprise": 0, "paid": 0, "free": 0}
    assert (await store.fleet_status()).queue_depth["paid"] == 0
    await gateway.enqueue("enterprise", envelope(1, "e", "enterprise"), place=Place("e", 5))
    assert await take_ids(store, 10) == ["e:r0001"]  # (the planted list goes)
    assert not await store.redis.exists(fq)
    await store.redis.rpush(fq, "junk")
    assert (await gateway.admit([], "paid", envelope(2, "a"), place=Place("a", 5, 1, 10))).admitted
    assert await take_ids(store, 10) == ["a:r0002"]


async def test_jobs_wait_in_their_keys_fair_order(store: Store) -> None:
    """A tier's jobs are fair-queued as its requests are: a key's five jobs
    sent behind another's hundred go in the first batch, behind none of
    them (they queued in a list, first come first served, before)."""
    gateway = GatewayQueue(store, "gw")

    def job(n: int, key: str) -> wire.Envelope:
        now = clock.now_ms()
        return wire.Envelope(f"j{n:04}", "gw", "paid", key, f"in{n}", now, now + 60_000, job=True)

    for i in range(100):
        assert await gateway.enqueue_job(job(i, "a"), 1000, 60_000, Place("a", 10))
    for i in range(100, 105):
        assert await gateway.enqueue_job(job(i, "b"), 1000, 60_000, Place("b", 10))
    await store.redis.rpush(store.keys.credits("d1"), "w1")
    taken = await DispatcherQueue(store, "d1").take(
        "w1", "b", clock.now_ms(), Rule(10, 0, 0, min_slots=(0, 0, 0)), True
    )
    keys = [wire.decode_envelope(e).key_id for e in taken.envelopes]
    assert keys == ["a", "b"] * 5
