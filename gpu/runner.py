"""Running one batch on the backend: its live requests' inputs (long ones
fetched from beside the queue), one call per distinct input in the backend's
thread (``backend_thread.py``), bounded by the hang timeout, and a call that fails
split in halves and retried down to the single inputs that fail, so one
poisoned input fails only its own request. Whatever happens, the batch
comes back as a ``Finished`` that answers every request in it."""

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Literal, NoReturn

import msgspec
from infergate.base import clock, logs, tracing, wire
from infergate.base.errors import STORE_ERRORS
from infergate.base.loops import retry_until_done
from infergate.base.metrics import WorkerMetrics
from infergate.base.queue import inputs
from infergate.base.queue.recovery import RecoveryQueue
from infergate.base.queue.worker import WorkerQueue
from infergate.gpu.answers import NOTHING_TO_ANSWER, Answer, Answers, Finished
from infergate.gpu.backend import (
    MAX_BATCH,
    Backend,
    BackendError,
    Partial,
    UpstreamError,
    slot_keys,
)
from infergate.gpu.backend_thread import (
    BackendThread,
    Ran,
    Running,
    Stepped,
    Then,
    distinct_inputs,
    live_envelopes,
)
from infergate.gpu.batch_time import BatchTimes

log = logs.get(__name__)
_tracer = tracing.tracer(__name__)

# A batch of up to this many requests is answered in the same step that
# takes the next batch: its few replies add little to that step (building
# them takes about 1 µs each), and they reach their clients one round trip
# sooner than if they were published after the next batch has started.
ANSWERED_WITH_TAKE_MAX = 12

# Leaves the process at once (the backend's thread is stuck): the event and
# its fields are logged first.
ExitHung = Callable[..., Awaitable[NoReturn]]


class BatchRunner:
    """Runs a worker's batches on its backend, through its backend thread."""

    def __init__(
        self,
        backend: Backend,
        thread: BackendThread,
        queue: WorkerQueue,
        recovery: RecoveryQueue,
        answers: Answers,
        hang_timeout_ms: int,
        exit_hung: ExitHung,
        stopping: Callable[[], asyncio.Event],
        grace_left: Callable[[], float],
    ) -> None:
        self.backend = backend
        self.thread = thread
        self.queue = queue
        self.recovery = recovery
        self.answers = answers
        self.metrics: WorkerMetrics = answers.metrics
        self.worker_id = answers.worker_id
        # What each call should take, and how long it may (batch_time.py).
        self.times = BatchTimes(hang_timeout_ms)
        self._exit_hung = exit_hung
        self._stopping = stopping
        self._grace_left = grace_left
        # The take the backend thread runs after the last batch's call, if it runs one.
        self.stepping: concurrent.futures.Future[Stepped] | None = None
        self._backend_free_since: float | None = None  # monotonic s
        self._returned_at = 0.0  # monotonic s: when the last call returned

    @property
    def hang_timeout_ms(self) -> int:
        """The longest a full batch of long inputs may take (the backend thread's take's bound)."""
        return self.times.hang_timeout_ms(MAX_BATCH, MAX_BATCH * 4_096)

    def _timeout_ms(self, inputs: list[str]) -> int:
        return self.times.hang_timeout_ms(len(inputs), sum(map(len, inputs)))

    async def handle(self, data: bytes, running: Running | None = None) -> Finished:
        """Run one pulled batch; returns how to build its answer, whatever
        happens to it: an unreadable envelope is dropped (take_*.lua already
        drops most), an unreadable batch is dead-lettered, and a batch that
        fails outside the backend (or whose answer cannot be built) answers
        every request INFERENCE_FAILED."""
        try:
            # (one the backend thread started, it read already)
            batch, unreadable = (running.batch, 0) if running else wire.decode_batch(data)
        except msgspec.DecodeError:
            log.error("batch.unreadable", size=len(data))
            self.metrics.batches_failed.inc()
            try:
                await self.recovery.dead_letter_unreadable(self.worker_id, data)
            except STORE_ERRORS as exc:  # unreadable: there is no one to answer anyway
                log.error("batch.unreadable_not_kept", error=type(exc).__name__)
            return NOTHING_TO_ANSWER
        if unreadable:
            log.error("batch.envelopes_unreadable", batch_id=batch.id, count=unreadable)
        try:
            finished = await self.run_batch(batch, data, running)
        except Exception:
            self._log_failed(batch)
            if running is not None:
                # Its call ran (or runs) anyway: what the backend thread did after it is
                # learned, as the loop learns it after any call.
                ran = await self._adopt(running, self._timeout_ms(running.inputs))
                self.stepping = ran.stepping
            return Finished(len(batch.envelopes), partial(self.answers.failure, batch))
        return Finished(finished.size, partial(self._answer_or_failure, batch, finished))

    async def run_batch(
        self, batch: wire.Batch, data: bytes | None = None, running: Running | None = None
    ) -> Finished:
        """Run the batch (``data``: as it sits in processing, for the backend thread to
        take the next one after it; ``running``: the call the backend thread started on
        it)."""
        if not tracing.enabled:
            return await self._run_batch(batch, data, running)
        with _tracer.start_as_current_span(
            "worker.batch", links=tracing.links([e.trace for e in batch.envelopes])
        ) as span:
            span.set_attribute("infergate.batch_id", batch.id)
            span.set_attribute("infergate.batch_size", len(batch.envelopes))
            span.set_attribute("infergate.attempt", batch.attempt)
            span.set_attribute("infergate.backend", self.backend.name)
            return await self._run_batch(batch, data, running)

    async def call(
        self,
        inputs: list[str],
        timeout_ms: int | None = None,
        then: Then | None = None,
        running: Running | None = None,
        record: Literal["took", "anchor", ""] = "took",
    ) -> list[str]:
        """One backend call in the backend thread, bounded by the hang timeout: a new
        one, or the ``running`` one the backend thread started itself. Given ``then``,
        the backend thread may take the next batch as the call returns (``stepping``).
        ``record``: what its time is to the batch-time model: a call of real
        work ("took"), the warm-up's ("anchor"), or nothing (the load)."""
        timeout_ms = timeout_ms or self._timeout_ms(inputs)
        if running is not None:
            ran = await self._adopt(running, timeout_ms)
            started = running.started
        else:
            started = clock.monotonic_s()
            try:
                ran = await asyncio.wait_for(self.thread.call(inputs, then), timeout_ms / 1000.0)
            except TimeoutError:
                await self._exit_hung("worker.hung", hang_timeout_ms=timeout_ms, size=len(inputs))
        self._returned_at = ran.returned
        if ran.stepping is not None:
            self.stepping = ran.stepping
        if ran.error is not None:
            raise ran.error
        outputs = ran.outputs or []
        took_ms = (ran.returned - started) * 1000.0
        measured = (len(inputs), sum(map(len, inputs)), took_ms)
        if record == "took":
            self.times.took(*measured)
        elif record == "anchor":
            self.times.anchor(*measured)
        self.metrics.batch_duration.observe(took_ms / 1000.0)
        if len(outputs) != len(inputs):
            raise BackendError(f"backend returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs

    async def _adopt(self, running: Running, timeout_ms: int) -> Ran:
        """The outcome of the call the backend thread started, within what is left of
        its hang timeout (one already returned is taken as it is)."""
        if running.call.done():
            return running.call.result()
        left_s = timeout_ms / 1000.0 - (clock.monotonic_s() - running.started)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(running.call), max(0.0, left_s))
        except TimeoutError:
            if running.call.done():  # it returned in time; its news came late
                return running.call.result()
            await self._exit_hung(
                "worker.hung", hang_timeout_ms=timeout_ms, size=len(running.inputs)
            )

    async def _infer_isolating(
        self, inputs: list[str], then: Then | None = None, running: Running | None = None
    ) -> list[str | BackendError]:
        """Run the batch; on failure split it and retry the halves, down to the
        single inputs that fail."""
        try:
            return list(await self.call(inputs, then=then, running=running))
        except Partial as exc:  # (each input answered apart: nothing to split)
            return exc.outcomes
        except UpstreamError as exc:  # (no input is at fault: nothing to split)
            return [exc] * len(inputs)
        except BackendError as exc:
            if len(inputs) == 1:
                return [exc]
            mid = len(inputs) // 2
            log.warning("batch.split", size=len(inputs), error=str(exc)[:200])
            return [
                *await self._infer_isolating(inputs[:mid]),
                *await self._infer_isolating(inputs[mid:]),
            ]

    async def _run_batch(
        self, batch: wire.Batch, data: bytes | None, running: Running | None
    ) -> Finished:
        """Run the batch on the backend (or adopt the call the backend thread started
        on it); returns how to build its answer."""
        if running is not None:  # (formed from ``data``, so it is this batch's)
            started_ms, live = running.started_ms, running.live
        else:
            started_ms = clock.now_ms()
            live = live_envelopes(batch, started_ms)
        if len(live) < len(batch.envelopes):
            log.info(
                "batch.expired_skipped", batch_id=batch.id, count=len(batch.envelopes) - len(live)
            )
        lost: list[wire.Envelope] = []
        if running is None and inputs.any_beside(live):
            live, lost = await self._with_inputs(batch.id, live)
        if not live:
            # Nothing to run: the lost answered; its long inputs go as it leaves processing.
            return Finished(len(lost), partial(self.answers.lost, batch, lost, started_ms))
        started = running.started if running else clock.monotonic_s()
        idle_ms = self._backend_idle_ms(started)
        # Identical inputs in one batch take one slot of the backend's call:
        # each distinct input once, its outcome to every request that sent it.
        distinct = running.inputs if running else distinct_inputs(live)
        # (the backend thread decided for a running call itself)
        big = len(live) > ANSWERED_WITH_TAKE_MAX
        then = Then(data) if data is not None and big and running is None else None
        outputs = await self._infer_isolating(distinct, then, running)
        outcome_of = dict(zip(slot_keys(distinct), outputs, strict=True))
        self._backend_free_since = self._returned_at
        infer_us = round((self._returned_at - started) * 1e6)
        build = partial(
            self.answers.of, batch, live, outcome_of, started_ms, infer_us, idle_ms, lost
        )
        return Finished(len(live) + len(lost), build)

    async def _with_inputs(
        self, batch_id: str, live: list[wire.Envelope]
    ) -> tuple[list[wire.Envelope], list[wire.Envelope]]:
        """``live`` with its long inputs fetched (``inputs.py``), and the
        envelopes whose input is gone. Retried while Redis is away; once
        stopping, past the publish grace, the worker leaves as for a hung
        call: the batch stays in processing for the reaper."""
        fetched: tuple[list[wire.Envelope], list[wire.Envelope]] = ([], [])

        async def fetch() -> None:
            nonlocal fetched
            fetched = await self.queue.with_inputs(live)

        if not await retry_until_done(
            "batch.inputs", fetch, self._stopping(), grace_after_stop_s=self._grace_left
        ):
            await self._exit_hung("worker.inputs_unreachable", batch_id=batch_id)
        ready, lost = fetched
        if lost:
            log.error("batch.inputs_lost", batch_id=batch_id, count=len(lost))
        return ready, lost

    def _backend_idle_ms(self, now: float) -> float | None:
        """How long the backend sat idle before this call: under load, the
        gap between two batches (None before the first)."""
        if self._backend_free_since is None:
            return None
        idle_s = now - self._backend_free_since
        self.metrics.backend_idle.observe(idle_s)
        return round(idle_s * 1000.0, 2)

    def _answer_or_failure(self, batch: wire.Batch, finished: Finished) -> Answer:
        try:
            return finished.answer()
        except Exception:
            self._log_failed(batch)
            return self.answers.failure(batch)

    def _log_failed(self, batch: wire.Batch) -> None:
        """Called while handling the exception: its traceback goes in the log."""
        log.exception("batch.failed", batch_id=batch.id, size=len(batch.envelopes))
        self.metrics.batches_failed.inc()
