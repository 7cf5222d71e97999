"""The backend's thread (``gpu/lane.py``): as a big batch's call returns, it
takes the next batch itself, from real Redis, and starts the backend on it;
it leaves the take to the event loop whenever that is the safe thing."""

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
from infergate.base import clock, wire
from infergate.base.queue.dispatcher import DispatcherQueue
from infergate.base.queue.forming import Rule
from infergate.base.queue.gateway import GatewayQueue
from infergate.base.queue.store import Store
from infergate.base.queue.worker import WorkerQueue
from infergate.gpu.backend import BackendError
from infergate.gpu.lane import Lane, Ran, Then
from infergate.gpu.simulated import SimulatedBackend
from infergate.gpu.worker import Worker, WorkerSettings
from infergate.redis_server import RedisServer


class Gated:
    """A backend whose first call waits until the test lets it return."""

    name = "gated"
    fingerprint = "gated"

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.fail = fail

    def infer(self, inputs: list[str]) -> list[str]:
        self.calls.append(list(inputs))
        if len(self.calls) == 1:
            assert self.release.wait(10)
            if self.fail:
                raise BackendError("failed")
        return [s.upper() for s in inputs]


def envelope(i: int) -> bytes:
    now = clock.now_ms()
    return wire.encode(wire.Envelope(f"r{i}", "gw", "paid", "k", f"in{i}", now, now + 30_000))


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    await DispatcherQueue(store, "d1").publish_rule(Rule(100, 0, -1, min_slots=(0, 0, 0)))
    await store.redis.lpush(store.keys.processing("w1"), b"batch A")
    yield store
    await store.close()


async def _run_first(store: Store, lane: Lane, backend: Gated, queued: int) -> Ran:
    """Call the backend for batch A; while it runs, ``queued`` requests arrive."""
    call = lane.call(["a"], Then(b"batch A"))
    for i in range(queued):
        await GatewayQueue(store, "gw").enqueue("paid", envelope(i))
    backend.release.set()
    return await asyncio.wait_for(call, 10)


def _lane(store: Store, redis_url: str, backend: Gated, may_take: bool = True) -> Lane:
    take = WorkerQueue(store, "w1").blocking_take(redis_url, timeout_s=2.0)
    return Lane(backend, take, lambda: may_take, chain_min=0)


async def test_the_lane_takes_the_next_batch_and_starts_it_as_the_call_returns(
    store: Store, redis_url: str
) -> None:
    backend = Gated()
    lane = _lane(store, redis_url, backend)
    try:
        ran = await _run_first(store, lane, backend, queued=3)
        assert ran.outputs == ["A"]
        assert ran.stepped is not None
        taken, running = ran.stepped.taken, ran.stepped.running
        assert taken is not None
        assert taken.size == 3
        assert running is not None
        # Formed from what was queued when the call returned, into processing
        # beside the batch just run, and already on the backend.
        assert await store.redis.lrange(store.keys.processing("w1"), 0, -1) == [
            taken.batch,
            b"batch A",
        ]
        assert running.data == taken.batch
        assert running.inputs == ["in0", "in1", "in2"]
        following = await asyncio.wait_for(running.call, 10)
        assert following.outputs == ["IN0", "IN1", "IN2"]
        assert backend.calls == [["a"], ["in0", "in1", "in2"]]
        # Batch A's answer is not out yet: the lane took nothing more.
        assert following.stepped is None
        assert not lane.answered.is_set()
    finally:
        lane.close()


async def test_the_lane_leaves_the_take_to_the_event_loop_when_it_must(
    store: Store, redis_url: str
) -> None:
    """Not while the last answer is out, not once stopping, not after a
    failed call: nothing is taken, and the queue is as it was."""
    for case in ("answer out", "stopping", "failed call"):
        backend = Gated(fail=case == "failed call")
        lane = _lane(store, redis_url, backend, may_take=case != "stopping")
        if case == "answer out":
            lane.answered.clear()
        try:
            ran = await _run_first(store, lane, backend, queued=1)
        finally:
            lane.close()
        assert ran.stepped is None, case
        assert isinstance(ran.error, BackendError) == (case == "failed call")
        assert await store.redis.lrange(store.keys.processing("w1"), 0, -1) == [b"batch A"]
        assert await store.redis.llen(store.keys.queue("paid")) == 1, case
        await store.redis.delete(store.keys.queue("paid"))


async def test_a_take_that_fails_leaves_its_step_to_the_event_loop(store: Store) -> None:
    """Redis unreachable from the lane: the call's outcome still comes back,
    with the step's token for the event loop to repeat, and nothing started."""
    backend = Gated()
    dead = RedisServer().start()
    dead_url = dead.url
    dead.close()
    lane = _lane(store, dead_url, backend)
    try:
        ran = await _run_first(store, lane, backend, queued=1)
    finally:
        lane.close()
    assert ran.outputs == ["A"]
    assert ran.stepped is not None
    assert ran.stepped.taken is None
    assert ran.stepped.running is None
    assert ran.stepped.step
    assert lane.answered.is_set()
    assert backend.calls == [["a"]]


async def test_a_worker_under_load_runs_batch_after_batch_from_its_lane(redis_url: str) -> None:
    """A worker given a big batch, with more arriving while it runs, forms
    and starts the next batches from its backend's thread, and answers
    every request once."""
    worker = Worker(WorkerSettings("w-lane", redis_url), SimulatedBackend(latency_ms=150))
    store = worker.store
    await DispatcherQueue(store, "d1").publish_rule(Rule(20, 0, -1, min_slots=(0, 0, 0)))
    gateway = GatewayQueue(store, "gw")
    pubsub = store.redis.pubsub()
    await pubsub.subscribe(store.keys.reply_channel("gw"))
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    answered: dict[str, int] = {}
    try:
        for i in range(20):
            await gateway.enqueue("paid", envelope(i))
        dispatcher = DispatcherQueue(store, "d1")
        credit = await dispatcher.wait_credit(10)
        assert credit == "w-lane"
        first = await dispatcher.take(
            credit, "b0", clock.now_ms(), Rule(20, 0, -1, min_slots=(0, 0, 0))
        )
        assert first.size == 20
        for i in range(20, 60):  # while the first batch runs
            await gateway.enqueue("paid", envelope(i))
        deadline = clock.monotonic_s() + 20
        while len(answered) < 60 and clock.monotonic_s() < deadline:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                for result in wire.decode_reply(message["data"]).results:
                    answered[result.id] = answered.get(result.id, 0) + 1
        assert sorted(answered) == sorted(f"r{i}" for i in range(60))
        assert set(answered.values()) == {1}
        assert worker.lane.steps >= 2  # batches two and three came from the lane
    finally:
        stop.set()
        await asyncio.wait_for(serving, 20)
        await pubsub.aclose()
