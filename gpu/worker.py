"""A GPU worker: take one batch, run it, form the next batch itself, and
publish the replies while that one runs.

The moment the backend returns, one short step forms the worker's next
batch straight into its processing list, from what is queued at that
moment, in priority order (``take.lua``, 'worker'), and the backend starts
on it; the replies of the batch just run are built and published (and the
batch acked) while the next one runs. Under load the backend starts again
one round trip after it returned, with no dispatcher, credit, pull or
reply-building between the two calls: after a batch of more than
``ANSWERED_WITH_TAKE_MAX`` requests, the backend's own thread runs that step
and starts the next call itself (``lane.py``), without waiting on the
event loop in between; otherwise (and whenever the lane cannot) the event loop
runs it. With nothing queued, the same step offers the worker's credit, and
a dispatcher forms its next batch when work arrives (``pull_batch``).

A batch sits in ``processing:{worker}`` while it runs and until its replies
have been published (``answer_batch``): two at most, the one being answered
and the next. A worker that dies leaves them there for the reaper; a worker
that starts under an id that still holds batches recovers them first. A
backend call that fails is split in halves and retried down to the single
inputs that fail, so one poisoned input fails only its own request. A batch
that cannot be run for any other reason (unreadable, a bug) is still
answered: every request in it gets INFERENCE_FAILED, never silence until
its deadline. A call that runs past the hang timeout stops the worker: it
stops heartbeating and exits non-zero, so the batch is retried elsewhere.
"""

import asyncio
import concurrent.futures
import contextlib
import os
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NoReturn

import msgspec
from infergate.base import clock, logs, tracing, wire
from infergate.base.errors import STORE_ERRORS, UNAVAILABLE
from infergate.base.heartbeat import Heartbeater
from infergate.base.loops import Backoff, retry_until_done
from infergate.base.metrics import WorkerMetrics
from infergate.base.probes import Probes
from infergate.base.queue import inputs
from infergate.base.queue.forming import TakeResult, log_drops, new_batch_id
from infergate.base.queue.recovery import RecoveryQueue
from infergate.base.queue.replies import failure_replies, group_by_gateway
from infergate.base.queue.store import Store
from infergate.base.queue.worker import KeptAnswer, WorkerQueue
from infergate.base.settings import ProcessSettings
from infergate.gpu.backend import Backend, BackendError
from infergate.gpu.lane import Lane, Ran, Running, Stepped, Then, distinct_inputs, live_envelopes
from prometheus_client import CollectorRegistry

log = logs.get(__name__)
_tracer = tracing.tracer(__name__)

EXIT_HUNG = 3


@dataclass
class Answer:
    """What a batch run sends back: one reply per gateway, and the answers
    to keep for the result cache (stored with the reply)."""

    replies: dict[str, wire.Reply] = field(default_factory=dict)
    keep: list[KeptAnswer] = field(default_factory=list)
    # The long inputs kept beside the batch's envelopes, deleted with the answer.
    inputs_done: list[str] = field(default_factory=list)
    # The batch's metrics and log line, once the answer is out (or given up
    # on): off the way of the replies (a log line written just after an
    # idle spell takes about 0.2 ms on this project's 2-core test machine).
    report: Callable[[], None] = lambda: None


class Finished:
    """A batch the backend has run. Its answer is built once, when it is
    first sent: for all but a small batch, once the next batch has started."""

    def __init__(self, size: int, build: Callable[[], Answer]) -> None:
        self.size = size  # the requests it answers
        self._build = build
        self._answer: Answer | None = None

    def answer(self) -> Answer:
        if self._answer is None:
            self._answer = self._build()
        return self._answer


NOTHING_TO_ANSWER = Finished(0, Answer)

# A batch of up to this many requests is answered in the same step that
# takes the next batch: its few replies add little to that step (building
# them takes about 1 µs each), and they reach their clients one round trip
# sooner than if they were published after the next batch has started.
ANSWERED_WITH_TAKE_MAX = 12

# A take in the backend's thread that has not answered by the hang timeout
# plus this long is stuck (its client times out after 1 s a try).
LANE_TAKE_BOUND_S = 5.0


@dataclass(frozen=True)
class WorkerSettings(ProcessSettings):
    hang_timeout_ms: int = 2_000
    max_attempts: int = 2
    pull_timeout_s: float = 1.0
    # After SIGTERM, how long to keep trying to publish a finished batch while
    # Redis is away; past it the batch stays in processing for the reaper.
    publish_grace_s: float = 5.0


class Worker:
    def __init__(self, settings: WorkerSettings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.id = settings.process_id
        self.store = Store.connect(
            settings.redis_url,
            settings.namespace,
            block_s=settings.pull_timeout_s,
            name="worker:" + self.id,
        )
        self.queue = WorkerQueue(self.store, self.id)
        # Short timeouts: a take the lane cannot finish is repeated by the loop.
        self._blocking_take = self.queue.blocking_take(settings.redis_url, timeout_s=1.0)
        # The backend's thread; under load it takes and starts the next batch itself.
        self.lane = Lane(
            backend,
            self._blocking_take,
            lambda: not self.stopping.is_set(),
            ANSWERED_WITH_TAKE_MAX,
            self._blocking_take.with_inputs,
        )
        # The take the lane runs after the last batch's call, if it runs one.
        self._stepping: concurrent.futures.Future[Stepped] | None = None
        self.registry = CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry)
        self.metrics.busy.set_function(lambda: 1.0 if self.busy else 0.0)
        self.metrics.redis_up.set_function(lambda: 1.0 if self.heartbeat.healthy else 0.0)
        self.recovery = RecoveryQueue(self.store, self.id)
        self.started_ms = clock.now_ms()
        self.busy = False
        # Set at SIGTERM: the heartbeat says draining at once, so admission
        # stops counting this worker while it finishes its batch.
        self.stopping = asyncio.Event()
        self.batches_done = 0
        self.requests_done = 0
        self.batch_ms_ewma: float | None = None
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic s, requests) per batch
        self._backend_free_since: float | None = None  # monotonic s
        self._returned_at = 0.0  # monotonic s: when the last call returned
        # The last batch's answer, going out while the next batch runs.
        self._answering: asyncio.Task[None] | None = None
        self._stop_seen_at: float | None = None  # monotonic s; the publish grace counts from it
        self.heartbeat = Heartbeater(
            self.store, self.status, settings.heartbeat_interval_ms, settings.heartbeat_ttl_ms
        )

    # -- what the heartbeat and the probes say ------------------------------

    def probes(self) -> Probes:
        return Probes(
            alive=self.heartbeat.alive,
            ready=lambda: self.heartbeat.healthy and not self.stopping.is_set(),
        )

    def status(self) -> wire.Heartbeat:
        now = clock.monotonic_s()
        window_s = 5.0
        while self._recent and self._recent[0][0] < now - window_s:
            self._recent.popleft()
        delivered = sum(n for _, n in self._recent) / window_s
        return wire.Heartbeat(
            role="worker",
            id=self.id,
            started_ms=self.started_ms,
            beat_ms=clock.now_ms(),
            busy=self.busy,
            batches_done=self.batches_done,
            requests_done=self.requests_done,
            delivered_rps=round(delivered, 1),
            batch_ms=round(self.batch_ms_ewma or 0.0, 2),
            draining=self.stopping.is_set(),
            model=self.backend.fingerprint,
        )

    # -- running the backend -------------------------------------------------

    async def _call(
        self,
        inputs: list[str],
        timeout_ms: int | None = None,
        then: Then | None = None,
        running: Running | None = None,
    ) -> list[str]:
        """One backend call in the lane, bounded by the hang timeout: a new
        one, or the ``running`` one the lane started itself. Given ``then``,
        the lane may take the next batch as the call returns (``_stepping``)."""
        timeout_ms = timeout_ms or self.settings.hang_timeout_ms
        if running is not None:
            ran = await self._adopt(running, timeout_ms)
            started = running.started
        else:
            started = clock.monotonic_s()
            try:
                ran = await asyncio.wait_for(self.lane.call(inputs, then), timeout_ms / 1000.0)
            except TimeoutError:
                await self._exit_hung("worker.hung", hang_timeout_ms=timeout_ms, size=len(inputs))
        self._returned_at = ran.returned
        if ran.stepping is not None:
            self._stepping = ran.stepping
        if ran.error is not None:
            raise ran.error
        outputs = ran.outputs or []
        took_ms = (ran.returned - started) * 1000.0
        self.metrics.batch_duration.observe(took_ms / 1000.0)
        self.batch_ms_ewma = (
            took_ms if self.batch_ms_ewma is None else 0.8 * self.batch_ms_ewma + 0.2 * took_ms
        )
        if len(outputs) != len(inputs):
            raise BackendError(f"backend returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs

    async def _adopt(self, running: Running, timeout_ms: int) -> Ran:
        """The outcome of the call the lane started, within what is left of
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

    async def _exit_hung(self, event: str, **fields: object) -> NoReturn:
        """The backend's thread, which cannot be interrupted, is stuck: the
        last batch's answer, if still going out, is finished first (within
        the grace, while the heartbeat still says this worker holds it);
        then the worker exits at once, without acking, so what it holds
        stays in processing for the reaper."""
        log.error(event, **fields)
        if self._answering is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.shield(self._answering), self.settings.publish_grace_s
                )
        await self.heartbeat.stop()
        sys.stderr.flush()
        os._exit(EXIT_HUNG)

    async def _infer_isolating(
        self, inputs: list[str], then: Then | None = None, running: Running | None = None
    ) -> list[str | BackendError]:
        """Run the batch; on failure split it and retry the halves, down to the
        single inputs that fail."""
        try:
            return list(await self._call(inputs, then=then, running=running))
        except BackendError as exc:
            if len(inputs) == 1:
                return [exc]
            mid = len(inputs) // 2
            log.warning("batch.split", size=len(inputs), error=str(exc)[:200])
            return [
                *await self._infer_isolating(inputs[:mid]),
                *await self._infer_isolating(inputs[mid:]),
            ]

    async def run_batch(
        self, batch: wire.Batch, data: bytes | None = None, running: Running | None = None
    ) -> Finished:
        """Run the batch (``data``: as it sits in processing, for the lane to
        take the next one after it; ``running``: the call the lane started on
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

    async def _run_batch(
        self, batch: wire.Batch, data: bytes | None, running: Running | None
    ) -> Finished:
        """Run the batch on the backend (or adopt the call the lane started
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
            if lost:
                return Finished(len(lost), partial(self._lost_answer, batch, lost, started_ms))
            # Nothing to run or answer; its long inputs go as it leaves processing.
            return Finished(0, partial(self._lost_answer, batch, [], started_ms))
        started = running.started if running else clock.monotonic_s()
        idle_ms = self._backend_idle_ms(started)
        # Identical inputs in one batch take one slot of the backend's call:
        # each distinct input once, its outcome to every request that sent it.
        distinct = running.inputs if running else distinct_inputs(live)
        # (the lane decided for a running call itself)
        big = len(live) > ANSWERED_WITH_TAKE_MAX
        then = Then(data) if data is not None and big and running is None else None
        outputs = await self._infer_isolating(distinct, then, running)
        outcome_of = dict(zip(distinct, outputs, strict=True))
        self._backend_free_since = self._returned_at
        infer_ms = round((self._returned_at - started) * 1000.0)
        build = partial(
            self._answer_of, batch, live, outcome_of, started_ms, infer_ms, idle_ms, lost
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
            "batch.inputs", fetch, self.stopping, grace_after_stop_s=self._grace_left
        ):
            await self._exit_hung("worker.inputs_unreachable", batch_id=batch_id)
        ready, lost = fetched
        if lost:
            log.error("batch.inputs_lost", batch_id=batch_id, count=len(lost))
        return ready, lost

    def _lost_answer(self, batch: wire.Batch, lost: list[wire.Envelope], started_ms: int) -> Answer:
        """A batch whose every live request's input is gone (or with none
        live): each of those answered, and the batch's inputs let go."""
        return Answer(
            group_by_gateway(self._lost_results(batch, lost, started_ms, len(lost))),
            inputs_done=inputs.input_keys(self.store.keys, batch.envelopes),
        )

    def _lost_results(
        self, batch: wire.Batch, lost: list[wire.Envelope], started_ms: int, size: int
    ) -> list[tuple[str, wire.Result]]:
        """SERVICE_OVERLOADED, to be retried, for each request whose long
        input was gone: not INFERENCE_FAILED, which says the input itself
        failed (and is passed to every request collapsed onto it)."""
        error = wire.ErrorInfo(
            "SERVICE_OVERLOADED", "the request's input was no longer in Redis; retry"
        )
        return [
            (
                wire.destination(env),
                wire.Result(
                    id=env.id,
                    batch_id=batch.id,
                    batch_size=size,
                    worker=self.id,
                    queue_ms=max(0, started_ms - env.enqueued_ms),
                    infer_ms=0,
                    error=error,
                ),
            )
            for env in lost
        ]

    def _backend_idle_ms(self, now: float) -> float | None:
        """How long the backend sat idle before this call: under load, the
        gap between two batches (None before the first)."""
        if self._backend_free_since is None:
            return None
        idle_s = now - self._backend_free_since
        self.metrics.backend_idle.observe(idle_s)
        return round(idle_s * 1000.0, 2)

    def _answer_of(
        self,
        batch: wire.Batch,
        live: list[wire.Envelope],
        outcome_of: dict[str, str | BackendError],
        started_ms: int,
        infer_ms: int,
        idle_ms: float | None,
        lost: list[wire.Envelope],
    ) -> Answer:
        """The replies of a batch the backend has run (and of the requests
        in it whose long input was gone), and the answers to keep."""
        answer = Answer()
        size = len(live) + len(lost)
        results = self._lost_results(batch, lost, started_ms, size) if lost else []
        for env in live:
            # Reported as served by the model, whichever copy ran: the keys of a
            # batch must not learn from served_by that another sent the same input.
            result = _result(
                env, outcome_of[wire.input_of(env)], batch.id, size, self.id, started_ms, infer_ms
            )
            results.append((wire.destination(env), result))
            if env.cache_key and env.cache_ttl_ms > 0 and result.output is not None:
                answer.keep.append(
                    KeptAnswer(
                        env.cache_key, self.backend.fingerprint, result.output, env.cache_ttl_ms
                    )
                )
        answer.replies = group_by_gateway(results)
        # (the batch leaves processing with its answer: none of them runs again)
        answer.inputs_done = inputs.input_keys(self.store.keys, batch.envelopes)
        self.batches_done += 1
        self.requests_done += len(live)
        self._recent.append((clock.monotonic_s(), len(live)))
        answer.report = partial(self._report, batch, live, outcome_of, infer_ms, idle_ms)
        return answer

    def _report(
        self,
        batch: wire.Batch,
        live: list[wire.Envelope],
        outcome_of: dict[str, str | BackendError],
        infer_ms: int,
        idle_ms: float | None,
    ) -> None:
        """A batch's metrics and log line."""
        failed = sum(isinstance(outcome_of[wire.input_of(e)], BackendError) for e in live)
        self.metrics.backend_inputs.inc(len(outcome_of))
        self.metrics.requests_collapsed.inc(len(live) - len(outcome_of))
        self.metrics.batch_size.observe(len(live))
        self.metrics.inference_failures.inc(failed)
        log.info(
            "batch.done",
            batch_id=batch.id,
            size=len(live),
            attempt=batch.attempt,
            infer_ms=infer_ms,
            idle_ms=idle_ms,
            failed=failed,
        )

    async def handle(self, data: bytes, running: Running | None = None) -> Finished:
        """Run one pulled batch; returns how to build its answer, whatever
        happens to it: an unreadable envelope is dropped (take.lua already
        drops most), an unreadable batch is dead-lettered, and a batch that
        fails outside the backend (or whose answer cannot be built) answers
        every request INFERENCE_FAILED."""
        try:
            # (one the lane started, it read already)
            batch, unreadable = (running.batch, 0) if running else wire.decode_batch(data)
        except msgspec.DecodeError:
            log.error("batch.unreadable", size=len(data))
            self.metrics.batches_failed.inc()
            try:
                await self.recovery.dead_letter_unreadable(self.id, data)
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
                # Its call ran (or runs) anyway: what the lane did after it is
                # learned, as the loop learns it after any call.
                ran = await self._adopt(running, self.settings.hang_timeout_ms)
                self._stepping = ran.stepping
            return Finished(len(batch.envelopes), partial(self._failure_answer, batch))
        return Finished(finished.size, partial(self._answer_or_failure, batch, finished))

    def _answer_or_failure(self, batch: wire.Batch, finished: Finished) -> Answer:
        try:
            return finished.answer()
        except Exception:
            self._log_failed(batch)
            return self._failure_answer(batch)

    def _log_failed(self, batch: wire.Batch) -> None:
        """Called while handling the exception: its traceback goes in the log."""
        log.exception("batch.failed", batch_id=batch.id, size=len(batch.envelopes))
        self.metrics.batches_failed.inc()

    def _failure_answer(self, batch: wire.Batch) -> Answer:
        """Every request of a batch that failed outside the backend gets
        INFERENCE_FAILED (and the cache keeps nothing of it)."""
        replies = failure_replies(
            batch,
            "INFERENCE_FAILED",
            "the worker could not run this batch",
            self.id,
            clock.now_ms(),
        )
        return Answer(replies, inputs_done=inputs.input_keys(self.store.keys, batch.envelopes))

    # -- the loop ----------------------------------------------------------------

    async def warm_up(self) -> None:
        """One real call before taking work: loads the model and measures the
        batch time. A first call can be slow (weights, kernels): its own bound."""
        await self._call(["warm-up"], timeout_ms=max(60_000, self.settings.hang_timeout_ms))
        log.info(
            "worker.warm", batch_ms=round(self.batch_ms_ewma or 0.0, 1), backend=self.backend.name
        )

    async def _register(self) -> None:
        """Batches left under this id by an earlier life are recovered first."""
        outcomes = await self.recovery.recover_worker(self.id, self.settings.max_attempts)
        if outcomes:
            log.warning("worker.recovered_own_batches", outcomes=outcomes)
        await self.heartbeat.beat_once()
        await self.queue.offer_credit()

    async def serve(self, stop: asyncio.Event) -> int:
        self.stopping = stop
        await self.warm_up()
        if not await retry_until_done("worker.register", self._register, stop):
            await self._close()
            return 0
        self.heartbeat.start()
        log.info("worker.started", worker_id=self.id)
        try:
            await self._loop(stop)
        finally:
            await self.heartbeat.stop()
            await retry_until_done("worker.retire", self._retire, stop, grace_after_stop_s=2.0)
            await self._close()
        log.info(
            "worker.stopped",
            worker_id=self.id,
            batches=self.batches_done,
            requests=self.requests_done,
        )
        return 0

    async def _close(self) -> None:
        await asyncio.to_thread(self.lane.close, 5.0)
        self._blocking_take.close()
        await self.store.close()

    async def _retire(self) -> None:
        await self.queue.withdraw_credit()
        if await self.queue.batch_in_hand() is not None:
            # Not answered (Redis was away past the grace): the heartbeat goes,
            # the membership stays, so the reaper finds this worker dead and
            # runs the batch again.
            log.warning("worker.left_a_batch", worker_id=self.id)
            await self.store.retire("worker", self.id, keep_membership=True)
            return
        await self.queue.forget_last_step()
        await self.store.retire("worker", self.id)

    async def _loop(self, stop: asyncio.Event) -> None:
        backoff = Backoff(base_s=0.1, cap_s=2.0)
        unsure = False  # a pull failed: its batch may be in processing anyway
        following: bytes | None = None  # the next batch, formed when the last one ran
        running: Running | None = None  # the call the lane started on it
        try:
            while following is not None or not stop.is_set():
                try:
                    data, following = following, None
                    lane_call, running = running, None
                    if data is None:
                        # Idle: the last answer is out (its batch off processing)
                        # before anything else is read from there.
                        await self._answer_settled()
                        if stop.is_set():
                            continue
                    if data is None and unsure:
                        data = await self.queue.batch_in_hand()
                    unsure = False
                    if data is None:
                        unsure = True
                        data = await self.queue.pull_batch(self.settings.pull_timeout_s)
                        unsure = False
                    if data is None:
                        await self._keep_credit_offered()
                        continue
                except UNAVAILABLE as exc:
                    log.warning("worker.redis_unavailable", error=type(exc).__name__)
                    await backoff.sleep()
                    continue
                except Exception:
                    log.exception("worker.pull_failed")
                    await backoff.sleep()
                    continue
                backoff.reset()
                self.busy = True
                finished = await self.handle(data, lane_call)
                stepped = await self._lane_step()
                # At most two batches in processing: the last answer went out
                # while this batch ran (as a rule, long before it returned).
                await self._answer_settled()
                if stepped is not None and stepped.taken is not None:
                    # The lane took the next batch as the call returned (and
                    # started it, unless it needs this loop).
                    following, running = self._took(stepped.taken), stepped.running
                    self._answer_later(finished, stop, data)
                    if stepped.taken.credit_lost:
                        await self._restore_credit(stop)
                else:
                    answer = finished.answer() if finished.size <= ANSWERED_WITH_TAKE_MAX else None
                    step = stepped.step if stepped else None  # the lane's, which failed
                    answered, following = await self._take_next(data, stop, answer, step)
                    if not answered:
                        # Not answered (stopping, Redis away past the grace): this
                        # batch, and the next one if the take formed it, stay for
                        # the reaper.
                        self._answer_later(finished, stop, data)
                self.busy = following is not None
        finally:
            self.lane.stop_taking()  # nothing takes a batch this loop will not run
            await self._answer_settled()

    async def _lane_step(self) -> Stepped | None:
        """What the lane's take after this batch's call did, if it ran one.
        (The replies are built after it: built meanwhile, they hold the GIL
        the lane needs to start the next call.)"""
        stepping, self._stepping = self._stepping, None
        if stepping is None:
            return None
        # Its client's timeouts bound it; past this bound (a resolver or a
        # Sentinel that hangs) it could still start a batch: the worker
        # leaves, as for a hung call.
        bound_s = self.settings.hang_timeout_ms / 1000.0 + LANE_TAKE_BOUND_S
        try:
            stepped = await asyncio.wait_for(asyncio.wrap_future(stepping), bound_s)
        except TimeoutError:
            await self._exit_hung("lane.take_hung", bound_s=bound_s)
        if stepped.taken is None:
            log.warning("lane.take_failed", error=stepped.error, step=stepped.step)
        return stepped

    async def _restore_credit(self, stop: asyncio.Event) -> None:
        await retry_until_done(
            "worker.credit", self._keep_credit_offered, stop, grace_after_stop_s=self._grace_left
        )

    def _answer_later(self, finished: Finished, stop: asyncio.Event, data: bytes) -> None:
        """Answer ``data`` in the background (while the next batch runs);
        the lane takes again once that answer is out."""
        self.lane.answered.clear()
        self._answering = asyncio.create_task(self._answer(finished, stop, data))

    async def _answer_settled(self) -> None:
        """Wait for the last batch's answer to be out (or given up on)."""
        task, self._answering = self._answering, None
        if task is None:
            return
        try:
            await task
        except Exception:  # a bug: its batch stays in processing, found by the next take
            log.exception("batch.answer_failed", worker_id=self.id)

    async def _keep_credit_offered(self) -> None:
        """Idle: make sure the credit is still out (a restarted Redis lost it)."""
        if await self.queue.ensure_credit():
            log.warning("worker.credit_restored", worker_id=self.id)

    async def _take_next(
        self, ran: bytes, stop: asyncio.Event, answer: Answer | None = None, step: str | None = None
    ) -> tuple[bool, bytes | None]:
        """The backend is free: the next batch, formed straight into
        processing (or the credit offered when there is none to take), with
        ``answer`` published and ``ran`` acked in the same step if given.
        Retried for as long as the worker lives; not started once stopping,
        and a step under way when stop comes is retried for the publish
        grace (a lost reply's batch is learned, and run). Returns whether
        ``ran`` was answered, and the next batch. ``step``: the token of a
        step the lane tried and could not finish (it may have run: it is
        repeated, once stopping too, as a step under way)."""
        if stop.is_set() and step is None:
            return False, None
        following: bytes | None = None
        # The same for every attempt: a repeat is known.
        step = step or new_batch_id()
        replies, keep, inputs_done = (
            (answer.replies, answer.keep, answer.inputs_done) if answer else (None, (), ())
        )

        async def take() -> None:
            nonlocal following
            taken = await self.queue.take_next(
                ran, step, clock.now_ms(), replies, keep, inputs_done
            )
            if taken.credit_lost:
                await self._keep_credit_offered()
            following = self._took(taken)

        try:
            done = await retry_until_done(
                "batch.take", take, stop, grace_after_stop_s=self._grace_left
            )
        except BaseException:  # (cancelled: the worker exits) its log line all the same
            if answer is not None:
                answer.report()
            raise
        if done and answer is not None:
            self.lane.answered.set()
            answer.report()
        return done and answer is not None, following

    def _took(self, taken: TakeResult) -> bytes | None:
        """Count what a take did (here or in the lane); returns the next
        batch. (A take that reports the credit lost found the batch gone:
        the reaper took it, or Redis lost it; no credit went out in it, and
        the caller makes sure one is out.)"""
        self.metrics.forming.count(taken)
        log_drops(taken)
        return taken.batch

    def _grace_left(self) -> float:
        """What is left of ``publish_grace_s`` once stopping: one grace,
        counted from when a failing step first saw the stop, for the take and
        the answers together (so the worker's shutdown grace still covers
        them)."""
        now = clock.monotonic_s()
        if self._stop_seen_at is None:
            self._stop_seen_at = now
        return max(0.0, self.settings.publish_grace_s - (now - self._stop_seen_at))

    async def _answer(self, finished: Finished, stop: asyncio.Event, batch: bytes) -> None:
        """Build the replies and publish them, and ack: retried for as long
        as the worker lives (the work is done); once stopping, for
        ``publish_grace_s``, after which the batch stays in processing and
        the reaper runs it again."""
        answer = finished.answer()
        # Decided once, so every attempt is the same step: a worker stopping
        # takes its credit back with the ack.
        leaving = stop.is_set()

        async def publish() -> None:
            await self.queue.answer_batch(
                answer.replies,
                clock.now_ms(),
                batch,
                answer.keep,
                leaving=leaving,
                inputs_done=answer.inputs_done,
            )

        try:
            if await retry_until_done(
                "batch.publish", publish, stop, grace_after_stop_s=self._grace_left
            ):
                self.lane.answered.set()
            else:
                log.error("batch.left_for_the_reaper", worker_id=self.id)
        finally:
            answer.report()


def _result(
    env: wire.Envelope,
    outcome: str | BackendError,
    batch_id: str,
    batch_size: int,
    worker_id: str,
    started_ms: int,
    infer_ms: int,
) -> wire.Result:
    common = dict(
        id=env.id,
        batch_id=batch_id,
        batch_size=batch_size,
        worker=worker_id,
        queue_ms=max(0, started_ms - env.enqueued_ms),
        infer_ms=infer_ms,
    )
    if isinstance(outcome, BackendError):
        error = wire.ErrorInfo("INFERENCE_FAILED", str(outcome)[:500] or "the backend failed")
        return wire.Result(**common, error=error)  # type: ignore[arg-type]
    return wire.Result(**common, output=outcome)  # type: ignore[arg-type]
