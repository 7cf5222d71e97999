"""The data model's atomic moves, against a real Redis."""

import asyncio

import msgspec
import pytest

from dispatcher import wire
from dispatcher.broker import Broker, connect
from dispatcher.keys import TIERS, Keys
from infergate import clock


def env(i: int, tier: str, deadline_in_ms: int = 10_000) -> bytes:
    now = clock.now_ms()
    return wire.encode(wire.Envelope(f"r{i}", "gw", tier, "k", f"in{i}", now, now + deadline_in_ms))


@pytest.fixture
async def broker(redis_url: str):
    client = connect(redis_url, block_s=1)
    yield Broker(client, Keys("t"))
    await client.aclose()


def ids(envelopes: list[bytes]) -> list[str]:
    return [wire.decode_envelope(e).id for e in envelopes]


async def test_take_is_priority_ordered_and_fifo_within_a_tier(broker: Broker) -> None:
    for i, tier in enumerate(["free", "paid", "free", "enterprise", "paid", "enterprise"]):
        await broker.enqueue(tier, env(i, tier))
    taken = await broker.take("d1", 5, clock.now_ms(), [0, 0, 0])
    assert ids(taken.envelopes) == ["r3", "r5", "r1", "r4", "r0"]
    assert await broker.redis.llen(broker.keys.inflight("d1")) == 5
    assert await broker.redis.llen(broker.keys.queue("free")) == 1
    # Work was left behind: the doorbell rang again for another dispatcher.
    assert await broker.redis.llen(broker.keys.doorbell) == 1


async def test_min_share_is_served_before_strict_priority(broker: Broker) -> None:
    for i in range(10):
        await broker.enqueue("enterprise", env(i, "enterprise"))
    for i in range(10, 15):
        await broker.enqueue("free", env(i, "free"))
    taken = await broker.take("d1", 10, clock.now_ms(), [0, 0, 2])
    assert ids(taken.envelopes) == ["r10", "r11", *[f"r{i}" for i in range(8)]]


async def test_expired_and_cancelled_never_leave_the_queue_for_a_worker(broker: Broker) -> None:
    await broker.enqueue("free", env(1, "free", deadline_in_ms=-1))
    await broker.enqueue("free", env(2, "free"))
    await broker.enqueue("free", env(3, "free"))
    await broker.cancel("r2", clock.now_ms() + 60_000)
    taken = await broker.take("d1", 10, clock.now_ms(), [0, 0, 0])
    assert ids(taken.envelopes) == ["r3"]
    assert (taken.expired, taken.cancelled) == (1, 1)
    stats = await broker.stats()
    assert stats["expired_dropped"] == 1
    assert stats["cancelled_dropped"] == 1


async def test_handoff_and_worker_round_trip(broker: Broker) -> None:
    await broker.offer_credit("w1")
    assert await broker.wait_credit("d1", 1) == "w1"
    await broker.enqueue("paid", env(1, "paid"))
    taken = await broker.take("d1", 100, clock.now_ms(), [0, 0, 0])
    batch = wire.encode_batch("b1", "d1", clock.now_ms(), taken.envelopes)
    await broker.handoff("d1", "w1", batch, 1, clock.now_ms())
    assert await broker.redis.llen(broker.keys.inflight("d1")) == 0
    assert await broker.redis.llen(broker.keys.credits("d1")) == 0
    data = await broker.pull_batch("w1", 1)
    assert data is not None
    decoded = wire.decode_batch(data)
    assert decoded.id == "b1"
    assert [e.id for e in decoded.envelopes] == ["r1"]
    assert await broker.redis.llen(broker.keys.processing("w1")) == 1
    pubsub = broker.redis.pubsub()
    await pubsub.subscribe(broker.keys.reply_channel("gw"))
    reply = wire.Reply([wire.Result("r1", "b1", 1, "w1", 0, 100, output="out")])
    await broker.publish_and_finish("w1", {"gw": reply}, offer_credit=True)
    assert await broker.redis.llen(broker.keys.processing("w1")) == 0
    assert await broker.redis.lrange(broker.keys.ready, 0, -1) == [b"w1"]
    msg = None
    for _ in range(20):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg:
            break
    assert msg is not None
    assert wire.decode_reply(msg["data"]) == reply
    await pubsub.aclose()


async def test_requeue_returns_inflight_to_the_front_in_order(broker: Broker) -> None:
    for i in range(4):
        await broker.enqueue("free", env(i, "free"))
    await broker.offer_credit("w1")
    await broker.wait_credit("d1", 1)
    await broker.take("d1", 3, clock.now_ms(), [0, 0, 0])
    await broker.enqueue("free", env(9, "free"))
    assert await broker.requeue("d1") == (3, 1)
    assert await broker.redis.lrange(broker.keys.ready, 0, -1) == [b"w1"]
    taken = await broker.take("d2", 10, clock.now_ms(), [0, 0, 0])
    assert ids(taken.envelopes) == ["r0", "r1", "r2", "r3", "r9"]


async def test_pacing_holds_a_partial_batch_but_never_a_full_one(broker: Broker) -> None:
    now = clock.now_ms()
    await broker.redis.set(broker.keys.last_dispatch, now)
    await broker.enqueue("free", env(1, "free"))
    held = await broker.take("d1", 3, now + 5, [0, 0, 0], min_interval_ms=25)
    assert held.envelopes == []
    assert 0 < held.wait_ms <= 20
    for i in range(2, 4):
        await broker.enqueue("free", env(i, "free"))
    full = await broker.take("d1", 3, now + 5, [0, 0, 0], min_interval_ms=25)
    assert ids(full.envelopes) == ["r1", "r2", "r3"]


async def test_concurrent_takes_never_share_an_envelope(broker: Broker) -> None:
    for i in range(300):
        await broker.enqueue(TIERS[i % 3], env(i, TIERS[i % 3]))
    results = await asyncio.gather(
        *(broker.take(f"d{j}", 40, clock.now_ms(), [0, 0, 0]) for j in range(10))
    )
    all_ids = [i for r in results for i in ids(r.envelopes)]
    assert len(all_ids) == len(set(all_ids)) == 300


def test_envelope_wire_format_round_trips() -> None:
    e = wire.Envelope("id", "gw", "free", "k", 'ünï "quoted"', 1, 2)
    assert wire.decode_envelope(wire.encode(e)) == e
    with pytest.raises(msgspec.DecodeError):
        wire.decode_envelope(b"{}")
