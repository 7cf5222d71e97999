"""Heartbeats against a real Redis: a beat that may rest (a gateway's for
one model) comes less often, with a longer TTL, while it says nothing new,
and is back at its interval for the next thing it has to say; one that may
not (a worker's) never rests; a dispatcher's rests only while it holds
nothing, and its key has the short TTL again before it holds anything."""

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from infergate.base import clock, wire
from infergate.base.heartbeat import REST, Heartbeater
from infergate.base.loops import Supervised
from infergate.base.queue.store import Store

from tests.helpers import until

INTERVAL_MS, TTL_MS = 100, 400


class Beats:
    """What a process says each beat (its count, moved on each beat while
    ``busy``), and when each beat was taken (monotonic s)."""

    def __init__(self) -> None:
        self.at: list[float] = []
        self.count = 0
        self.busy = True
        self.taken = asyncio.Event()

    def status(self) -> wire.Heartbeat:
        if self.busy:
            self.count += 1
        self.at.append(time.monotonic())
        self.taken.set()
        return wire.Heartbeat("gateway", "g1", 0, clock.now_ms(), admitted=self.count)

    async def next(self) -> float:
        self.taken.clear()
        await asyncio.wait_for(self.taken.wait(), 5.0)
        return self.at[-1]


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    store = Store.connect(redis_url, "hb", block_s=1, name="test")
    yield store
    await store.close()


async def test_a_beat_that_says_nothing_new_rests_and_the_next_news_is_at_its_interval(
    store: Store,
) -> None:
    beats = Beats()
    hb = Heartbeater(store, beats.status, INTERVAL_MS, TTL_MS, rests=True)
    key = store.keys.heartbeat("gateway", "g1")
    hb.start()
    try:
        # Busy: each beat says a new count, every interval, with the TTL.
        for _ in range(4):
            await beats.next()
        await beats.next()  # (the one before it is written)
        assert not hb.resting
        assert 0 < await store.redis.pttl(key) <= TTL_MS
        # Nothing new: the beat rests, its key lives REST times longer.
        beats.busy = False
        await until(lambda: hb.resting, 2.0, "the beat to rest")
        await beats.next()
        assert await store.redis.pttl(key) > TTL_MS
        assert hb.loop.interval_s == REST * INTERVAL_MS / 1000.0
        # (REST intervals apart on the grid; at the interval, one apart)
        for _ in range(3):
            before = beats.at[-1]
            assert await beats.next() - before > 2 * INTERVAL_MS / 1000.0
        # Something new just after a resting beat, while the loop waits: the
        # next beat at the interval's next tick, not the resting one's, a
        # REST interval away.
        last = await beats.next()
        await until(lambda: hb.loop._pause is not None, 2.0, "the wait for the next tick")
        beats.count += 1
        hb.stir()
        assert await beats.next() - last < 3 * INTERVAL_MS / 1000.0

        async def said_the_news() -> bool:  # (the beat taken is written a round trip later)
            return wire.decode_heartbeat(await store.redis.get(key)).admitted == beats.count

        await until(said_the_news, 1.0, "the news in the heartbeat key")
    finally:
        await hb.stop()


async def test_a_beat_that_may_not_rest_keeps_its_interval_and_ttl(store: Store) -> None:
    beats = Beats()
    beats.busy = False
    hb = Heartbeater(store, beats.status, INTERVAL_MS, TTL_MS)
    hb.start()
    try:
        for _ in range(6):  # (one that rests would from the second)
            await beats.next()
            assert not hb.resting
            assert hb.loop.interval_s == INTERVAL_MS / 1000.0
        assert 0 < await store.redis.pttl(store.keys.heartbeat("gateway", "g1")) <= TTL_MS
    finally:
        await hb.stop()


async def test_a_beat_rests_only_while_it_holds_nothing_and_is_short_before_it_holds(
    store: Store,
) -> None:
    beats = Beats()
    beats.busy = False
    holding = [True]
    hb = Heartbeater(store, beats.status, INTERVAL_MS, TTL_MS, rests=True, holds=lambda: holding[0])
    key = store.keys.heartbeat("gateway", "g1")
    hb.start()
    try:
        for _ in range(4):  # (saying nothing new, but holding: never at rest)
            await beats.next()
            assert not hb.resting
        assert 0 < await store.redis.pttl(key) <= TTL_MS
        holding[0] = False
        await until(lambda: hb.resting, 2.0, "the beat to rest")
        await until(lambda: hb._ttl_written_ms > TTL_MS, 2.0, "the resting beat to be written")
        assert await store.redis.pttl(key) > TTL_MS
        # About to hold: the key's TTL is the short one when this returns,
        # and the beats come at the interval again.
        holding[0] = True
        await hb.before_holding()
        assert 0 < await store.redis.pttl(key) <= TTL_MS
        assert hb.loop.interval_s == INTERVAL_MS / 1000.0
        for _ in range(3):
            await beats.next()
            assert not hb.resting
        assert 0 < await store.redis.pttl(key) <= TTL_MS
        # Nothing rested since: nothing to write (one round trip spared).
        written = len(beats.at)
        await hb.before_holding()
        assert len(beats.at) == written
    finally:
        await hb.stop()


async def test_a_loop_hastened_while_it_waits_steps_at_the_shorter_tick() -> None:
    """``hasten`` moves the wait under way (here a minute long) to the new
    interval's next tick; a loop stopped while it waits leaves no timer."""
    steps: list[float] = []

    async def step() -> None:
        steps.append(time.monotonic())

    loop = Supervised("hastened", step, 60.0)
    loop.start()
    try:
        await until(lambda: steps and loop._pause is not None, 2.0, "the first wait")
        asked = time.monotonic()
        loop.hasten(0.05)
        await until(lambda: len(steps) >= 3, 2.0, "the hastened steps")
        assert steps[1] - asked < 0.5  # (the minute's tick: 0.8 % of the time this near)
        await until(lambda: loop._pause is not None, 2.0, "a wait")
        tick = loop._tick
    finally:
        await loop.stop()
    assert tick is not None
    assert tick.cancelled()
    assert (loop._pause, loop._tick) == (None, None)
