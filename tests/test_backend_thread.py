"""The backend's thread (``gpu/backend_thread.py``): as a big batch's call returns, it
takes the next batch itself, from real Redis, and starts the backend on it;
it leaves the take to the event loop whenever that is the safe thing."""

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from infergate.base import clock, wire
from infergate.base.queue.dispatcher import DispatcherQueue
from infergate.base.queue.forming import Rule, TakeResult
from infergate.base.queue.gateway import GatewayQueue
from infergate.base.queue.inputs import BESIDE_MIN_CHARS
from infergate.base.queue.store import Store
from infergate.base.queue.worker import WorkerQueue
from infergate.gpu.backend import BackendError
from infergate.gpu.backend_thread import BackendThread, Ran, Then
from infergate.gpu.backends.simulated import SimulatedBackend
from infergate.gpu.worker import Worker, WorkerSettings

from tests.helpers import paid_envelope, queued


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


class Counting(SimulatedBackend):
    """The simulated backend, counting the inputs it ran."""

    inputs = 0

    def infer(self, inputs: list[str]) -> list[str]:
        self.inputs += len(inputs)
        return super().infer(inputs)


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    await DispatcherQueue(store, "d1").publish_rule(Rule(100, 0, -1, min_slots=(0, 0, 0)))
    await store.redis.lpush(store.keys.processing("w1"), b"batch A")
    yield store
    await store.close()


async def _run_first(store: Store, thread: BackendThread, backend: Gated, queued: int) -> Ran:
    """Call the backend for batch A; while it runs, ``queued`` requests arrive."""
    call = thread.call(["a"], Then(b"batch A"))
    for i in range(queued):
        await GatewayQueue(store, "gw").enqueue("paid", paid_envelope(i))
    backend.release.set()
    return await asyncio.wait_for(call, 10)


def _thread(store: Store, redis_url: str, backend: Gated, may_take: bool = True) -> BackendThread:
    take = WorkerQueue(store, "w1").blocking_take(redis_url, timeout_s=2.0)
    return BackendThread(backend, take, lambda: may_take, chain_min=0, with_inputs=take.with_inputs)


def _close(thread: BackendThread) -> None:
    thread.close(5)
    thread._take.close()  # type: ignore[attr-defined]


async def test_the_backend_thread_takes_the_next_batch_and_starts_it_as_the_call_returns(
    store: Store, redis_url: str
) -> None:
    backend = Gated()
    thread = _thread(store, redis_url, backend)
    try:
        ran = await _run_first(store, thread, backend, queued=3)
        assert ran.outputs == ["A"]
        assert ran.stepping is not None
        stepped = await asyncio.wrap_future(ran.stepping)
        taken, running = stepped.taken, stepped.running
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
        following = await asyncio.wait_for(asyncio.wrap_future(running.call), 10)
        assert following.outputs == ["IN0", "IN1", "IN2"]
        assert backend.calls == [["a"], ["in0", "in1", "in2"]]
        # Batch A's answer is not out yet: the backend thread took nothing more.
        assert following.stepping is None
        assert not thread.answered.is_set()
    finally:
        _close(thread)


async def test_the_backend_thread_fetches_long_inputs_before_it_starts_their_batch(
    store: Store, redis_url: str
) -> None:
    """Kept beside the queue (``inputs.py``), they are fetched on the take's
    client; a batch with one gone is left to the event loop, which answers it."""
    gateway = GatewayQueue(store, "gw")
    texts = [f"{i}" + "z" * BESIDE_MIN_CHARS for i in range(2)]
    for lose_one in (False, True):
        backend = Gated()
        take = WorkerQueue(store, "w1").blocking_take(redis_url, timeout_s=2.0)
        fetched: list[tuple[list[wire.Envelope], list[wire.Envelope]]] = []

        def with_inputs(
            envs: list[wire.Envelope], take: Any = take, fetched: list[Any] = fetched
        ) -> Any:
            fetched.append(take.with_inputs(envs))
            return fetched[-1]

        thread = BackendThread(backend, take, lambda: True, chain_min=0, with_inputs=with_inputs)
        try:
            call = thread.call(["a"], Then(b"batch A"))
            for i, text in enumerate(texts):
                now = clock.now_ms()
                env = wire.Envelope(f"r{i}", "gw", "paid", "k", text, now, now + 30_000)
                await gateway.enqueue("paid", *gateway.stored(env))
            if lose_one:
                await store.redis.delete(store.keys.input("gw", "r1"))
            backend.release.set()
            ran = await asyncio.wait_for(call, 10)
            assert ran.stepping is not None
            stepped = await asyncio.wrap_future(ran.stepping)
            assert stepped.taken is not None
            assert stepped.taken.size == 2
            if lose_one:
                # Fetched, r1's found gone: the event loop runs the batch.
                assert [[e.id for e in lost] for _, lost in fetched] == [["r1"]]
                assert stepped.running is None
                assert backend.calls == [["a"]]
            else:
                assert stepped.running is not None
                assert stepped.running.inputs == texts
                following = await asyncio.wait_for(asyncio.wrap_future(stepped.running.call), 10)
                assert following.outputs == [t.upper() for t in texts]
        finally:
            _close(thread)
        await store.redis.delete(store.keys.processing("w1"))
        await store.redis.lpush(store.keys.processing("w1"), b"batch A")
        await store.redis.delete(store.keys.last_step("w1"))


async def test_the_backend_thread_leaves_the_take_to_the_event_loop_when_it_must(
    store: Store, redis_url: str
) -> None:
    """Not while the last answer is not out yet, not once stopping, not after a
    failed call: nothing is taken, and the queue is as it was."""
    for case in ("answer not out", "stopping", "failed call"):
        backend = Gated(fail=case == "failed call")
        thread = _thread(store, redis_url, backend, may_take=case != "stopping")
        if case == "answer not out":
            thread.answered.clear()
        try:
            ran = await _run_first(store, thread, backend, queued=1)
        finally:
            _close(thread)
        assert ran.stepping is None, case
        assert isinstance(ran.error, BackendError) == (case == "failed call")
        assert await store.redis.lrange(store.keys.processing("w1"), 0, -1) == [b"batch A"]
        assert await queued(store, "paid") == 1, case
        await store.redis.delete(
            *store.keys.queues, *store.keys.fair_queues, *store.keys.fair_states
        )


async def test_a_take_that_fails_leaves_its_step_to_the_event_loop(store: Store) -> None:
    """Redis unreachable from the backend thread: the call's outcome still comes back,
    with the step's token for the event loop to repeat, and nothing started."""
    backend = Gated()
    thread = _thread(store, "redis://127.0.0.1:1/0", backend)  # nothing listens there
    try:
        ran = await _run_first(store, thread, backend, queued=1)
    finally:
        _close(thread)
    assert ran.outputs == ["A"]
    assert ran.stepping is not None
    stepped = await asyncio.wrap_future(ran.stepping)
    assert stepped.taken is None
    assert stepped.running is None
    assert stepped.step
    assert stepped.error == "ConnectionError"
    assert thread.answered.is_set()
    assert backend.calls == [["a"]]


async def test_a_take_whose_reply_is_lost_is_repeated_by_the_event_loop_with_its_token(
    store: Store, redis_url: str
) -> None:
    """The backend thread's take ran but its reply never came: the event loop repeats
    the step with the backend thread's token and gets the batch that step formed; no
    second batch is formed and no credit goes out."""
    backend = Gated()
    worker_queue = WorkerQueue(store, "w1")
    blocking = worker_queue.blocking_take(redis_url, timeout_s=2.0)

    def take_then_lose_the_reply(ran: bytes, step: str, now_ms: int) -> TakeResult:
        blocking(ran, step, now_ms)
        raise ConnectionError("the reply was lost")

    thread = BackendThread(
        backend,
        take_then_lose_the_reply,
        lambda: True,
        chain_min=0,
        with_inputs=blocking.with_inputs,
    )
    try:
        ran = await _run_first(store, thread, backend, queued=3)
        assert ran.stepping is not None
        stepped = await asyncio.wrap_future(ran.stepping)
    finally:
        thread.close(5)
        blocking.close()
    assert stepped.taken is None
    assert stepped.running is None
    assert backend.calls == [["a"]]  # nothing started without the event loop
    formed = await store.redis.lindex(store.keys.processing("w1"), 0)
    again = await worker_queue.take_next(b"batch A", stepped.step, clock.now_ms())
    assert again.batch == formed
    assert again.size == 0
    assert await store.redis.llen(store.keys.processing("w1")) == 2
    assert await queued(store, "paid") == 0
    assert await store.redis.llen(store.keys.ready) == 0


async def test_a_slow_take_does_not_hold_back_the_calls_outcome(
    store: Store, redis_url: str
) -> None:
    """The outcome is the event loop's as the backend returns (the hang
    timeout counts the call only); the take's result follows."""
    backend = Gated()
    blocking = WorkerQueue(store, "w1").blocking_take(redis_url, timeout_s=2.0)
    take_may_finish = threading.Event()

    def slow_take(ran: bytes, step: str, now_ms: int) -> TakeResult:
        assert take_may_finish.wait(10)
        return blocking(ran, step, now_ms)

    thread = BackendThread(
        backend, slow_take, lambda: True, chain_min=0, with_inputs=blocking.with_inputs
    )
    try:
        ran = await _run_first(store, thread, backend, queued=1)
        assert ran.stepping is not None
        assert not ran.stepping.done()
        take_may_finish.set()
        stepped = await asyncio.wrap_future(ran.stepping)
        assert stepped.taken is not None
        assert stepped.taken.size == 1
    finally:
        take_may_finish.set()
        thread.close(5)
        blocking.close()


async def _serve_60_requests(worker: Worker, backend: "Counting") -> dict[str, int]:
    """Serve 60 requests on ``worker``: a first batch of 20 handed over by a
    dispatcher, the other 40 arriving while it runs; returns how many times
    each request was answered, and checks that no batch ran twice and that
    processing never held more than two batches."""
    # The test's own client: the worker closes its store as it stops.
    settings = worker.settings
    store = Store.connect(settings.redis_url, settings.namespace, name="test", model=settings.model)
    await DispatcherQueue(store, "d1").publish_rule(Rule(20, 0, -1, min_slots=(0, 0, 0)))
    gateway = GatewayQueue(store, "gw")
    pubsub = store.redis.pubsub()
    await pubsub.subscribe(store.keys.reply_channel("gw"))
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    most_in_processing = 0

    watched = asyncio.Event()

    async def watch_processing() -> None:
        # (told to stop, not cancelled: a cancel that lands in a redis-py
        # command can be lost, and the watcher then outlives the test)
        nonlocal most_in_processing
        while not watched.is_set():
            held = await store.redis.llen(store.keys.processing(worker.id))
            most_in_processing = max(most_in_processing, held)
            await asyncio.sleep(0.005)

    watching = asyncio.create_task(watch_processing())
    answered: dict[str, int] = {}
    try:
        for i in range(20):
            await gateway.enqueue("paid", paid_envelope(i))
        dispatcher = DispatcherQueue(store, "d1")
        credit = await dispatcher.wait_credit(10)
        assert credit == worker.id
        first = await dispatcher.take(
            credit, "b0", clock.now_ms(), Rule(20, 0, -1, min_slots=(0, 0, 0))
        )
        assert first.size == 20
        for i in range(20, 60):  # while the first batch runs
            await gateway.enqueue("paid", paid_envelope(i))
        deadline = clock.monotonic_s() + 30
        while len(answered) < 60 and clock.monotonic_s() < deadline:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                for result in wire.decode_reply(message["data"]).results:
                    answered[result.id] = answered.get(result.id, 0) + 1
    finally:
        watched.set()
        await asyncio.wait_for(watching, 5)
        stop.set()
        await asyncio.wait_for(serving, 30)
        await pubsub.aclose()
        await store.close()
    assert sorted(answered) == sorted(f"r{i}" for i in range(60))
    # No batch ran twice (a running call is adopted, not run again), and
    # never more than the batch being answered and the next.
    assert backend.inputs == 60 + 2 + 2 * worker.settings.max_batch  # and the warm-up's
    assert most_in_processing <= 2
    return answered


async def test_a_worker_under_load_runs_batch_after_batch_from_its_backend_thread(
    redis_url: str,
) -> None:
    """A worker given a big batch, with more arriving while it runs, forms
    and starts the next batches from its backend's thread, and answers
    every request once."""
    backend = Counting(latency_ms=150)
    worker = Worker(WorkerSettings("w-thread", redis_url), backend)
    answered = await _serve_60_requests(worker, backend)
    assert set(answered.values()) == {1}
    assert worker.thread.steps >= 2  # batches two and three came from the backend thread


async def test_the_backend_thread_waits_for_the_last_answer_before_it_takes(redis_url: str) -> None:
    """Replies that take longer to go out than a batch takes to run: the
    thread never takes beside an unanswered batch (the event loop takes once
    the answer is out), so nothing runs twice and processing holds two
    batches at most."""
    backend = Counting(latency_ms=100)
    worker = Worker(WorkerSettings("w-slow-answers", redis_url), backend)
    publish = worker.queue.answer_batch

    async def slow_answer(*args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(0.3)
        await publish(*args, **kwargs)

    worker.queue.answer_batch = slow_answer  # type: ignore[method-assign]
    answered = await _serve_60_requests(worker, backend)
    assert set(answered.values()) == {1}
