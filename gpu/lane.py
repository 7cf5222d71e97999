"""The backend's own thread: one call at a time, and under load the next
batch formed and started from that thread the moment a call returns.

A call made through ``asyncio.to_thread`` crosses threads twice between
two batches: its result wakes the event loop, which takes the next batch
and wakes a thread again to run it. On a busy host each wake-up is a
scheduling delay (measured at 900 req/s on one worker of this project's
2-core test machine: about 2 ms of every cycle, beside the take itself).
So the lane runs a big batch's call with what it needs to take the next
one (``Then``): when the call returns, the same thread runs the worker's
take (``take.lua`` 'worker', on a blocking client), reads the batch it
formed, starts the backend on it, and only then posts both outcomes to the
event loop, which publishes the last batch's replies while the next runs
and adopts the running call (``Running``) as it comes to that batch.

The lane takes only when it is safe to, and otherwise leaves the take to
the event loop exactly as without it: not for a small batch (answered in
the take's own step there), not once the worker is stopping, not while the
last batch's answer is still going out (``answered``: at most two batches
in processing), and after a failed call not at all. A take that fails
leaves its step token to the event loop, which repeats the step (the same
batch comes back if it ran). A batch it took but cannot start (unreadable
envelopes, nothing live) goes to the event loop as any other.
"""

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from infergate.base import clock, wire
from infergate.base.queue.forming import TakeResult, new_batch_id
from infergate.gpu.backend import Backend


def live_envelopes(batch: wire.Batch, now_ms: int) -> list[wire.Envelope]:
    """The envelopes still worth running: a request past its deadline was
    answered 504 already; a job was started when it was taken, so it runs."""
    return [e for e in batch.envelopes if e.job or e.deadline_ms > now_ms]


def distinct_inputs(live: list[wire.Envelope]) -> list[str]:
    """Identical inputs in one batch take one slot of the backend's call."""
    return list(dict.fromkeys(e.input for e in live))


@dataclass(frozen=True)
class Then:
    """What a call's batch needs for the lane to take the next one."""

    ran: bytes  # the batch, as it sits in processing


@dataclass(frozen=True)
class Running:
    """A batch the lane took and started: the event loop adopts its call."""

    data: bytes
    batch: wire.Batch
    live: list[wire.Envelope]
    inputs: list[str]
    started_ms: int
    started: float  # monotonic s
    call: "asyncio.Future[Ran]"


@dataclass(frozen=True)
class Stepped:
    """The take the lane ran as a call returned: its result (None if it
    failed: the event loop repeats ``step``), and the batch it started."""

    step: str
    taken: TakeResult | None
    running: Running | None = None


@dataclass(frozen=True)
class Ran:
    """A call's outcome: outputs or the backend's error, when it returned
    (monotonic s), and the take that followed it, if the lane ran one."""

    outputs: list[str] | None
    error: BaseException | None
    returned: float
    stepped: Stepped | None = None


@dataclass(frozen=True)
class _Job:
    inputs: list[str]
    then: Then | None
    call: "asyncio.Future[Ran]"


class Lane:
    def __init__(
        self,
        backend: Backend,
        take: Callable[[bytes, str, int], TakeResult],
        may_take: Callable[[], bool],
        chain_min: int,
    ) -> None:
        """``take(ran, step, now_ms)`` runs the worker's take, blocking;
        ``may_take()`` says whether the lane may take now (not stopping);
        a batch of more than ``chain_min`` live requests is taken after."""
        self.backend = backend
        self._take = take
        self._may_take = may_take
        self._chain_min = chain_min
        # Set while nothing of this worker's waits to be answered: the lane
        # clears it when it takes (the batch just run is answered next), the
        # event loop sets it once that answer is out.
        self.answered = threading.Event()
        self.answered.set()
        self.steps = 0  # batches the lane took and started itself
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="backend-lane", daemon=True)

    def call(self, inputs: list[str], then: Then | None = None) -> "asyncio.Future[Ran]":
        """Run ``inputs`` once the lane is free; the future gets the outcome."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._thread.start()
        future: asyncio.Future[Ran] = loop.create_future()
        self._jobs.put(_Job(inputs, then, future))
        return future

    def close(self) -> None:
        """The thread ends after the call it is running (it is a daemon)."""
        self._jobs.put(None)

    # -- the thread -------------------------------------------------------------

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            while job is not None:
                job = self._run(job)

    def _run(self, job: _Job) -> _Job | None:
        """Run one call; returns the next one if the lane took and started it."""
        try:
            outputs, error = self.backend.infer(job.inputs), None
        except BaseException as exc:  # the event loop's to raise, as to_thread would
            outputs, error = None, exc
        returned = clock.monotonic_s()
        stepped = None
        whole = error is None and outputs is not None and len(outputs) == len(job.inputs)
        if whole and job.then is not None and self._may_take() and self.answered.is_set():
            stepped = self._step(job.then)
        self._post(job.call, Ran(outputs, error, returned, stepped))
        running = stepped.running if stepped else None
        if running is None:
            return None
        self.steps += 1
        then = Then(running.data) if len(running.live) > self._chain_min else None
        return _Job(running.inputs, then, running.call)

    def _step(self, then: Then) -> Stepped:
        step = new_batch_id()
        try:
            taken = self._take(then.ran, step, clock.now_ms())
        except Exception:  # the event loop repeats the step, and logs what it finds
            return Stepped(step, None)
        self.answered.clear()  # the batch just run is answered next
        return Stepped(step, taken, self._start(taken.batch))

    def _start(self, data: bytes | None) -> Running | None:
        """The batch taken, ready to run; None if it needs the event loop."""
        if data is None or self._loop is None:
            return None
        try:
            batch, unreadable = wire.decode_batch(data)
        except msgspec.DecodeError:
            return None
        started_ms = clock.now_ms()
        live = live_envelopes(batch, started_ms)
        if unreadable or not live or len(live) < len(batch.envelopes):
            return None  # logged there
        call: asyncio.Future[Ran] = self._loop.create_future()
        return Running(
            data, batch, live, distinct_inputs(live), started_ms, clock.monotonic_s(), call
        )

    def _post(self, future: "asyncio.Future[Ran]", ran: Ran) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_settle, future, ran)


def _settle(future: "asyncio.Future[Ran]", ran: Ran) -> None:
    if not future.done():  # its caller gave up (the worker is exiting)
        future.set_result(ran)
