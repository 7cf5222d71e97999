"""The backend's own thread: one call at a time, and under load the next
batch formed and started from that thread the moment a call returns.

A call made through ``asyncio.to_thread`` crosses threads twice between
two batches: its result wakes the event loop, which takes the next batch
and wakes a thread again to run it. On a busy host each wake-up is a
scheduling delay (one worker at 900 req/s on this project's 2-core test
machine: about 1.7 ms of every cycle, beside the take itself). So the backend thread
runs a big batch's call with what it needs to take the next one (``Then``):
when the call returns, its outcome goes to the event loop at once (so the
hang timeout counts the call alone), and the same thread runs the worker's take
(``take_worker.lua``, on a blocking client of its own), reads the batch
it formed and starts the backend on it. The event loop learns what the
take did (``Ran.stepping``), publishes the last batch's replies while the
next batch runs, and adopts the running call (``Running``) as it comes to
that batch.

The backend thread takes only when it is safe to, and otherwise leaves the take to
the event loop exactly as without it: not for a small batch (answered in
the take's own step there), not once the worker is stopping, not while the
last batch's answer is not out yet (``answered``: at most two batches in
processing), and not after a call that failed. A take that fails leaves its
step token to the event loop, which repeats the step (the same batch comes
back if it ran). A batch it took but does not start (unreadable envelopes,
any envelope past its deadline, a long input gone) goes to the event loop
as any other. Long inputs kept beside the queue are fetched here, on the
take's client, before the call starts.
"""

import asyncio
import concurrent.futures
import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from infergate.base import clock, wire
from infergate.base.queue.forming import TakeResult, new_batch_id
from infergate.base.queue.inputs import any_beside
from infergate.base.tiers import TIERS
from infergate.gpu.backend import Backend, Prompts, run

Future = concurrent.futures.Future
RANKS = {tier: i for i, tier in enumerate(TIERS)}


def live_envelopes(batch: wire.Batch, now_ms: int) -> list[wire.Envelope]:
    """The envelopes still worth running: a request past its deadline was
    answered 504 already; a job was started when it was taken, so it runs."""
    return [e for e in batch.envelopes if e.job or e.deadline_ms > now_ms]


# The slot of a backend call an envelope's answer comes from: its input
# (identical inputs share one), with its max_tokens if it asks for fewer
# tokens (an engine that stops there itself answers each its own), or, for a
# sampled one, a pair no input can equal (two samples are two draws, and no
# request can name another's).
SlotKey = str | tuple[str, str] | tuple[str, int, str]


def slot_key(env: wire.Envelope) -> SlotKey:
    if env.temperature:
        return ("sampled", env.id)
    if env.max_tokens or env.conversation is not None:  # (a chat's whole conversation)
        return (wire.input_of(env), env.max_tokens, env.conversation or "")
    return wire.input_of(env)


def distinct_inputs(live: list[wire.Envelope]) -> Prompts:
    """The inputs of the backend's call for a batch: one per slot."""
    slots: dict[SlotKey, wire.Envelope] = {}
    sampled = limited = chats = False
    deadline_ms = 0
    for env in live:
        if env.temperature:
            sampled = True
        if env.max_tokens:
            limited = True
        if env.conversation is not None:
            chats = True
        if env.deadline_ms > deadline_ms and not env.job:
            deadline_ms = env.deadline_ms
        key = slot_key(env)
        if key not in slots:
            slots[key] = env
    chosen = slots.values()
    return Prompts(
        [wire.input_of(e) for e in chosen],
        list(slots),
        [e.temperature for e in chosen] if sampled else None,
        min((RANKS.get(e.tier, len(TIERS)) for e in live), default=len(TIERS)),
        [e.max_tokens for e in chosen] if limited else None,
        deadline_ms,
        [e.conversation for e in chosen] if chats else None,
    )


@dataclass(frozen=True)
class Then:
    """What a call's batch needs for the backend thread to take the next one."""

    ran: bytes  # the batch, as it sits in processing


@dataclass(frozen=True)
class Running:
    """A batch the backend thread took and started: the event loop adopts its call."""

    data: bytes
    batch: wire.Batch
    live: list[wire.Envelope]
    inputs: list[str]
    started_ms: int
    started: float  # monotonic s
    call: "Future[Ran]"


@dataclass(frozen=True)
class Stepped:
    """The take the backend thread ran as a call returned: its result (None if it
    failed: the event loop repeats ``step``), and the batch it started."""

    step: str
    taken: TakeResult | None
    running: Running | None = None
    error: str = ""  # why the take failed


@dataclass(frozen=True)
class Ran:
    """A call's outcome: outputs or the backend's error, when it returned
    (monotonic s), and, if the backend thread takes after it, what that take does."""

    outputs: list[str] | None
    error: BaseException | None
    returned: float
    stepping: "Future[Stepped] | None" = None


@dataclass(frozen=True)
class _Job:
    inputs: list[str]
    then: Then | None
    call: "Future[Ran]"
    context: contextvars.Context


class BackendThread:
    def __init__(
        self,
        backend: Backend,
        take: Callable[[bytes, str, int], TakeResult],
        may_take: Callable[[], bool],
        chain_min: int,
        with_inputs: Callable[
            [list[wire.Envelope]], tuple[list[wire.Envelope], list[wire.Envelope]]
        ],
    ) -> None:
        """``take(ran, step, now_ms)`` runs the worker's take, blocking;
        ``may_take()`` says whether the backend thread may take now (not stopping);
        a batch of more than ``chain_min`` live requests is taken after;
        ``with_inputs(envelopes)`` fetches their long inputs, blocking
        (``inputs.filled``: those with them, those whose input is gone)."""
        self.backend = backend
        self._take = take
        self._with_inputs = with_inputs
        self._may_take = may_take
        self._chain_min = chain_min
        # Set while nothing of this worker's waits to be answered: cleared by
        # the backend thread when it takes (the batch just run is answered next) and by
        # the event loop when it starts an answer; set by the event loop once
        # an answer is out (its transaction, or a take's that answers).
        self.answered = threading.Event()
        self.answered.set()
        self._taking = True  # until the event loop stops running what the backend thread takes
        self._started = False
        self.steps = 0  # batches the backend thread took and started itself
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="backend-thread", daemon=True)

    def call(self, inputs: list[str], then: Then | None = None) -> "asyncio.Future[Ran]":
        """Run ``inputs`` once the backend thread is free (in the caller's context, as
        ``asyncio.to_thread`` would); the future gets the outcome."""
        if not self._started:
            self._started = True
            self._thread.start()
        call: Future[Ran] = Future()
        self._jobs.put(_Job(inputs, then, call, contextvars.copy_context()))
        return asyncio.wrap_future(call)

    def stop_taking(self) -> None:
        """From now on the backend thread takes nothing: nobody would run it."""
        self._taking = False

    def close(self, timeout_s: float) -> None:
        """End the thread once the call it runs (if any) returns."""
        self.stop_taking()
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- the thread -------------------------------------------------------------

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            while job is not None:
                job = self._run(job)

    def _run(self, job: _Job) -> _Job | None:
        """Run one call; returns the next one if the backend thread took and started it."""
        try:
            outputs, error = job.context.run(run, self.backend, job.inputs), None
        except BaseException as exc:  # the event loop's to raise, as to_thread would
            outputs, error = None, exc
        returned = clock.monotonic_s()
        whole = error is None and isinstance(outputs, list) and len(outputs) == len(job.inputs)
        may = self._taking and self._may_take() and self.answered.is_set()
        then = job.then if whole and may else None
        stepping: Future[Stepped] | None = Future() if then is not None else None
        # The outcome first: the hang timeout counts the call, not the take.
        _settle(job.call, Ran(outputs, error, returned, stepping))
        if then is None or stepping is None:
            return None
        stepped = self._step(then)
        _settle(stepping, stepped)
        running = stepped.running
        if running is None:
            return None
        self.steps += 1
        chain = Then(running.data) if len(running.live) > self._chain_min else None
        # A context of its own: the last batch's (its span, ended) is not this one's.
        return _Job(running.inputs, chain, running.call, contextvars.Context())

    def _step(self, then: Then) -> Stepped:
        step = new_batch_id()
        try:
            taken = self._take(then.ran, step, clock.now_ms())
        except Exception as exc:  # the event loop repeats the step, with this token
            return Stepped(step, None, error=type(exc).__name__)
        self.answered.clear()  # the batch just run is answered next
        try:
            running = self._start(taken.batch)
        except Exception:  # the event loop runs the batch taken
            running = None
        return Stepped(step, taken, running)

    def _start(self, data: bytes | None) -> Running | None:
        """The batch taken, ready to run; None if it needs the event loop."""
        if data is None:
            return None
        try:
            batch, unreadable = wire.decode_batch(data)
        except msgspec.DecodeError:
            return None
        started_ms = clock.now_ms()
        live = live_envelopes(batch, started_ms)
        if unreadable or not live or len(live) < len(batch.envelopes):
            return None  # logged there
        if any_beside(live):
            live, lost = self._with_inputs(live)
            if lost:
                return None  # answered there
        inputs = distinct_inputs(live)
        return Running(data, batch, live, inputs, started_ms, clock.monotonic_s(), Future())


def _settle(future: "Future[Ran] | Future[Stepped]", value: "Ran | Stepped") -> None:
    # Cancelled: its caller gave up (the worker exits).
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(value)  # type: ignore[arg-type]
