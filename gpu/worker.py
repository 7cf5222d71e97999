"""A GPU worker: take one batch, run it, publish the replies, and form the
next batch itself.

The transaction that answers a batch (publishes its replies, acks it) also
forms the worker's next batch straight into its processing list, from what
is queued at that moment, in priority order (``take.lua``, 'worker'): under
load the backend starts its next call one round trip after the last one
returned, with no dispatcher, credit or pull between them. With nothing
queued, the same step offers the worker's credit, and a dispatcher forms
its next batch when work arrives (``pull_batch``).

The batch sits in ``processing:{worker}`` while it runs; it leaves only when
the replies have been published (``answer_batch``). A worker that dies
leaves its batch there for the reaper; a worker that starts under an id
that still holds a batch recovers it first. A backend call that fails is
split in halves and retried down to the single inputs that fail, so one
poisoned input fails only its own request. A batch that cannot be run for
any other reason (unreadable, a bug) is still answered: every request in it
gets INFERENCE_FAILED, never silence until its deadline. A call that runs
past the hang timeout stops the worker: it stops heartbeating and exits
non-zero, so the batch is retried elsewhere.
"""

import asyncio
import os
import sys
from collections import deque
from dataclasses import dataclass

import msgspec
from infergate.base import clock, logs, tracing, wire
from infergate.base.errors import STORE_ERRORS, UNAVAILABLE
from infergate.base.heartbeat import Heartbeater
from infergate.base.loops import Backoff, retry_until_done
from infergate.base.metrics import WorkerMetrics
from infergate.base.probes import Probes
from infergate.base.queue.forming import TakeResult, log_drops
from infergate.base.queue.recovery import RecoveryQueue
from infergate.base.queue.replies import failure_replies, group_by_gateway
from infergate.base.queue.store import Store
from infergate.base.queue.worker import KeptAnswer, WorkerQueue
from infergate.base.settings import ProcessSettings
from infergate.gpu.backend import Backend, BackendError
from prometheus_client import CollectorRegistry

log = logs.get(__name__)
_tracer = tracing.tracer(__name__)

EXIT_HUNG = 3


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
        # Answers of the batch in hand for the result cache, stored with its answer.
        self.answers_to_keep: list[KeptAnswer] = []
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

    async def _call(self, inputs: list[str], timeout_ms: int | None = None) -> list[str]:
        """One backend call in a thread, bounded by the hang timeout."""
        timeout_ms = timeout_ms or self.settings.hang_timeout_ms
        started = clock.monotonic_s()
        call = asyncio.to_thread(self.backend.infer, inputs)
        try:
            outputs = await asyncio.wait_for(call, timeout_ms / 1000.0)
        except TimeoutError:
            log.error("worker.hung", hang_timeout_ms=timeout_ms, size=len(inputs))
            await self.heartbeat.stop()
            # The backend thread cannot be interrupted: leave at once, without
            # acking, so the batch stays in processing for the reaper.
            sys.stderr.flush()
            os._exit(EXIT_HUNG)
        took_ms = clock.elapsed_ms(started)
        self.metrics.batch_duration.observe(took_ms / 1000.0)
        self.batch_ms_ewma = (
            took_ms if self.batch_ms_ewma is None else 0.8 * self.batch_ms_ewma + 0.2 * took_ms
        )
        if len(outputs) != len(inputs):
            raise BackendError(f"backend returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs

    async def _infer_isolating(self, inputs: list[str]) -> list[str | BackendError]:
        """Run the batch; on failure split it and retry the halves, down to the
        single inputs that fail."""
        try:
            return list(await self._call(inputs))
        except BackendError as exc:
            if len(inputs) == 1:
                return [exc]
            mid = len(inputs) // 2
            log.warning("batch.split", size=len(inputs), error=str(exc)[:200])
            return [
                *await self._infer_isolating(inputs[:mid]),
                *await self._infer_isolating(inputs[mid:]),
            ]

    async def run_batch(self, batch: wire.Batch) -> dict[str, wire.Reply]:
        if not tracing.enabled:
            return await self._run_batch(batch)
        with _tracer.start_as_current_span(
            "worker.batch", links=tracing.links([e.trace for e in batch.envelopes])
        ) as span:
            span.set_attribute("infergate.batch_id", batch.id)
            span.set_attribute("infergate.batch_size", len(batch.envelopes))
            span.set_attribute("infergate.attempt", batch.attempt)
            span.set_attribute("infergate.backend", self.backend.name)
            return await self._run_batch(batch)

    async def _run_batch(self, batch: wire.Batch) -> dict[str, wire.Reply]:
        started_ms = clock.now_ms()
        # A request past its deadline was answered 504 already; a job was
        # started when it was taken, so it runs.
        live = [e for e in batch.envelopes if e.job or e.deadline_ms > started_ms]
        if len(live) < len(batch.envelopes):
            log.info(
                "batch.expired_skipped", batch_id=batch.id, count=len(batch.envelopes) - len(live)
            )
        if not live:
            return {}
        started = clock.monotonic_s()
        inputs = [e.input for e in live]
        # Identical inputs in one batch take one slot of the backend's call:
        # each distinct input once, its outcome to every request that sent it.
        distinct = list(dict.fromkeys(inputs))
        outcome_of = dict(zip(distinct, await self._infer_isolating(distinct), strict=True))
        infer_ms = round(clock.elapsed_ms(started))
        results = []
        for env in live:
            # Reported as served by the model, whichever copy ran: the keys of a
            # batch must not learn from served_by that another sent the same input.
            result = _result(
                env, outcome_of[env.input], batch.id, len(live), self.id, started_ms, infer_ms
            )
            results.append((wire.destination(env), result))
            self._keep(env, result)
        outcomes = [outcome_of[i] for i in inputs]
        self.metrics.backend_inputs.inc(len(distinct))
        self.metrics.requests_collapsed.inc(len(inputs) - len(distinct))
        failed = sum(isinstance(o, BackendError) for o in outcomes)
        self.metrics.batch_size.observe(len(live))
        self.metrics.inference_failures.inc(failed)
        self.batches_done += 1
        self.requests_done += len(live)
        self._recent.append((clock.monotonic_s(), len(live)))
        log.info(
            "batch.done",
            batch_id=batch.id,
            size=len(live),
            attempt=batch.attempt,
            infer_ms=infer_ms,
            failed=failed,
        )
        return group_by_gateway(results)

    def _keep(self, env: wire.Envelope, result: wire.Result) -> None:
        """With the result cache on for this request, keep its answer (stored
        in the transaction that answers the batch)."""
        if env.cache_key and env.cache_ttl_ms > 0 and result.output is not None:
            answer = KeptAnswer(
                env.cache_key, self.backend.fingerprint, result.output, env.cache_ttl_ms
            )
            self.answers_to_keep.append(answer)

    async def handle(self, data: bytes) -> dict[str, wire.Reply]:
        """The replies for one pulled batch, whatever happens to it: an
        unreadable envelope is dropped (take.lua already drops most), an
        unreadable batch is dead-lettered, and a batch that fails outside the
        backend answers every request INFERENCE_FAILED."""
        try:
            batch, unreadable = wire.decode_batch(data)
        except msgspec.DecodeError:
            log.error("batch.unreadable", size=len(data))
            self.metrics.batches_failed.inc()
            try:
                await self.recovery.dead_letter_unreadable(self.id, data)
            except STORE_ERRORS as exc:  # unreadable: there is no one to answer anyway
                log.error("batch.unreadable_not_kept", error=type(exc).__name__)
            return {}
        if unreadable:
            log.error("batch.envelopes_unreadable", batch_id=batch.id, count=unreadable)
        self.answers_to_keep = []
        try:
            return await self.run_batch(batch)
        except Exception:
            self.answers_to_keep = []  # no client got them: the cache must not either
            log.exception("batch.failed", batch_id=batch.id, size=len(batch.envelopes))
            self.metrics.batches_failed.inc()
            return failure_replies(
                batch,
                "INFERENCE_FAILED",
                "the worker could not run this batch",
                self.id,
                clock.now_ms(),
            )

    # -- the loop ----------------------------------------------------------------

    async def warm_up(self) -> None:
        """One real call before taking work: loads the model and measures the
        batch time. A first call can be slow (weights, kernels): its own bound."""
        await self._call(["warm-up"], timeout_ms=max(60_000, self.settings.hang_timeout_ms))
        log.info(
            "worker.warm", batch_ms=round(self.batch_ms_ewma or 0.0, 1), backend=self.backend.name
        )

    async def _register(self) -> None:
        """A batch left under this id by an earlier life is recovered first."""
        outcome = await self.recovery.recover_worker(self.id, self.settings.max_attempts)
        if outcome != "idle":
            log.warning("worker.recovered_own_batch", outcome=outcome)
        await self.heartbeat.beat_once()
        await self.queue.offer_credit()

    async def serve(self, stop: asyncio.Event) -> int:
        self.stopping = stop
        await self.warm_up()
        if not await retry_until_done("worker.register", self._register, stop):
            await self.store.close()
            return 0
        self.heartbeat.start()
        log.info("worker.started", worker_id=self.id)
        try:
            await self._loop(stop)
        finally:
            await self.heartbeat.stop()
            await retry_until_done("worker.retire", self._retire, stop, grace_after_stop_s=2.0)
            await self.store.close()
        log.info(
            "worker.stopped",
            worker_id=self.id,
            batches=self.batches_done,
            requests=self.requests_done,
        )
        return 0

    async def _retire(self) -> None:
        await self.queue.withdraw_credit()
        if await self.queue.batch_in_hand() is not None:
            # Not answered (Redis was away past the grace): the heartbeat goes,
            # the membership stays, so the reaper finds this worker dead and
            # runs the batch again.
            log.warning("worker.left_a_batch", worker_id=self.id)
            await self.store.retire("worker", self.id, keep_membership=True)
            return
        await self.store.retire("worker", self.id)

    async def _loop(self, stop: asyncio.Event) -> None:
        backoff = Backoff(base_s=0.1, cap_s=2.0)
        unsure = False  # a pull failed: its batch may be in processing anyway
        following: bytes | None = None  # the next batch, moved in by the last answer
        while following is not None or not stop.is_set():
            try:
                data, following = following, None
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
            replies = await self.handle(data)
            # Not answered (stopping, Redis away past the grace): this batch, and
            # a next one if the lost answer moved it in, stay for the reaper.
            following = await self._answer(replies, stop, data)
            self.busy = False

    async def _keep_credit_offered(self) -> None:
        """Idle: make sure the credit is still out (a restarted Redis lost it)."""
        if await self.queue.ensure_credit():
            log.warning("worker.credit_restored", worker_id=self.id)

    async def _answer(
        self, replies: dict[str, wire.Reply], stop: asyncio.Event, batch: bytes
    ) -> bytes | None:
        """Publish and ack: retried for as long as the worker lives (the work
        is done); once stopping, for ``publish_grace_s``, after which the
        batch stays in processing and the reaper runs it again. Returns the
        next batch if the answer formed one (or moved in one waiting)."""
        keep, self.answers_to_keep = self.answers_to_keep, []
        taken: TakeResult | None = None
        # Decided once: a retry (its reply lost) must repeat the same step, or
        # a next batch the first attempt formed would be left in processing.
        leaving = stop.is_set()

        async def answer() -> None:
            nonlocal taken
            taken = await self.queue.answer_batch(
                replies, clock.now_ms(), batch, keep, leaving=leaving
            )

        if not await retry_until_done(
            "batch.publish", answer, stop, grace_after_stop_s=self.settings.publish_grace_s
        ):
            log.error("batch.left_for_the_reaper", worker_id=self.id)
        if taken is None:
            return None
        if taken.credit_lost and not leaving:
            # The batch had gone (the reaper took it, or it was unreadable):
            # no credit went out in that step.
            await retry_until_done("worker.credit", self._keep_credit_offered, stop)
        self.metrics.forming.count(taken)
        log_drops(taken)
        return taken.batch


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
