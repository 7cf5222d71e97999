"""A GPU worker: take one batch, run it, form the next batch itself, and
publish the replies while that one runs.

The moment the backend returns, one short step forms the worker's next
batch straight into its processing list, from what is queued at that
moment, in priority order (``take_worker.lua``), and the backend starts
on it; the replies of the batch just run are built and published (and the
batch acked) while the next one runs. Under load the backend starts again
one round trip after it returned, with no dispatcher, credit, pull or
reply-building between the two calls: after a batch of more than
``ANSWERED_WITH_TAKE_MAX`` requests, the backend's own thread runs that step
and starts the next call itself (``backend_thread.py``), without waiting on the
event loop in between; otherwise (and whenever the backend thread cannot) the event loop
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

This module is the worker's life (start, heartbeat, stop); a batch's run is
``runner.py``, its answer ``answers.py``, and the loop ``batch_loop.py``.
"""

import asyncio
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

from infergate.base import clock, logs, wire
from infergate.base.errors import STORE_ERRORS
from infergate.base.heartbeat import Heartbeater
from infergate.base.loops import retry_until_done
from infergate.base.metrics import WorkerMetrics
from infergate.base.probes import Probes
from infergate.base.queue.forming import TakeResult, log_drops
from infergate.base.queue.recovery import RecoveryQueue
from infergate.base.queue.store import Store
from infergate.base.queue.worker import WorkerQueue
from infergate.base.settings import ProcessSettings
from infergate.gpu.answers import Answers, Finished, Tally
from infergate.gpu.backend import MAX_BATCH, Backend, BackendError, Unusable, unanswered
from infergate.gpu.backend_thread import BackendThread, Running
from infergate.gpu.batch_loop import BatchLoop
from infergate.gpu.gate import GatedBackend
from infergate.gpu.runner import ANSWERED_WITH_TAKE_MAX, BatchRunner
from infergate.gpu.token_weight import fleet_weights
from infergate.gpu.upstream import UpstreamWatch
from prometheus_client import CollectorRegistry

log = logs.get(__name__)

EXIT_HUNG = 3
EXIT_UNUSABLE = 2
# A worker says it is warming up for this long, again every two fifths of it.
WARMING_SAID_MS = 5_000
WARM_UP_INPUT = "warm up " * 64  # (512 characters)


@dataclass(frozen=True)
class WorkerSettings(ProcessSettings):
    hang_timeout_ms: int = 2_000
    max_attempts: int = 2
    pull_timeout_s: float = 1.0
    # After SIGTERM, how long to keep trying to publish a finished batch while
    # Redis is away; past it the batch stays in processing for the reaper.
    publish_grace_s: float = 5.0
    # How long usage per key is kept (the policy's usage.retention_days).
    usage_retention_s: int = 35 * 86_400
    # The model's full batch (its policy's max_batch_size): the warm-up times
    # one, and the heartbeat's batch time is that of one (batch_time.py).
    max_batch: int = 100
    # The batches its process keeps in flight (``workers.concurrency``): each
    # slot is a worker of its own to the fleet; the heartbeat says how many
    # share a process (the autoscaling signal counts processes).
    slots: int = 1


class SharedWarmUp:
    """One backend's warm-up for every member of a process that shares it
    (its slots, its shards' loops): the first runs it, the others start
    from its times. Its server is asked for one warm-up, not one a slot."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.anchors: list[tuple[int, int, float]] | None = None
        self.failed: str | None = None  # (why it failed: the others do not run it again)


class Worker:
    def __init__(
        self, settings: WorkerSettings, backend: Backend, warm: SharedWarmUp | None = None
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.shared_warm_up = warm or SharedWarmUp()
        self.id = settings.process_id
        self.store = Store.connect(
            settings.redis_url,
            settings.namespace,
            block_s=settings.pull_timeout_s,
            name="worker:" + self.id,
            model=settings.model,
        )
        self.queue = WorkerQueue(self.store, self.id, settings.usage_retention_s)
        # Short timeouts: a take the backend thread cannot finish is repeated by the loop.
        self._blocking_take = self.queue.blocking_take(settings.redis_url, timeout_s=1.0)
        # Set at SIGTERM: the heartbeat says draining at once, so admission
        # stops counting this worker while it finishes its batch.
        self.stopping = asyncio.Event()
        # The backend's thread; under load it takes and starts the next batch itself.
        # Shared with other shards' loops (gate.py).
        self.gated = backend if isinstance(backend, GatedBackend) else None
        self.thread = BackendThread(
            backend,
            self._blocking_take,
            lambda: not self.stopping.is_set(),
            ANSWERED_WITH_TAKE_MAX,
            self._blocking_take.with_inputs,
        )
        self.registry = CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry)
        self.recovery = RecoveryQueue(self.store, self.id)
        self.tally = Tally()
        answers = self.answers = Answers(
            self.id, self.store.keys, backend, self.metrics, self.tally
        )
        self.runner = BatchRunner(
            backend,
            self.thread,
            self.queue,
            self.recovery,
            answers,
            settings.hang_timeout_ms,
            self.exit_hung,
            lambda: self.stopping,
            self.grace_left,
        )
        self.watch = UpstreamWatch(backend.upstream, self.queue)
        self.loop = BatchLoop(
            self.runner,
            settings.pull_timeout_s,
            self.exit_hung,
            self.grace_left,
            self.watch,
            self.gated,
        )
        if self.gated is not None:
            self.gated.gate.attach(self.gated.shard, self._join_call, self._give_back_credit)
        self.metrics.busy.set_function(lambda: 1.0 if self.loop.busy else 0.0)
        self.metrics.redis_up.set_function(lambda: 1.0 if self.heartbeat.healthy else 0.0)
        self.started_ms = clock.now_ms()
        self.warm_ms = 0.0  # (the full batch time its warm-up measured, once warm)
        self._stop_seen_at: float | None = None  # monotonic s; the publish grace counts from it
        self.heartbeat = Heartbeater(
            self.store, self.status, settings.heartbeat_interval_ms, settings.heartbeat_ttl_ms
        )

    # -- the credit, while the shared backend runs another shard's batch (gate.py)

    def _join_call(self, room: int) -> tuple[int, bool]:
        if self.stopping.is_set():
            return 0, False
        # (marked until past the call's hang timeout, if it is never given back)
        mark_ms = self.runner.hang_timeout_ms + 1000
        taken = self._blocking_take.join_call(clock.now_ms(), mark_ms, room)
        self._count(taken)
        return taken.size, taken.size == 0 and not taken.credit_lost

    def _give_back_credit(self) -> bool:
        taken = self._blocking_take.give_back_credit(clock.now_ms())
        self._count(taken)
        return taken.size > 0

    def _count(self, taken: TakeResult) -> None:
        self.runner.metrics.forming.count(taken)
        log_drops(taken)

    # -- what the heartbeat and the probes say ------------------------------

    def probes(self) -> Probes:
        return Probes(
            alive=self.heartbeat.alive,
            ready=lambda: self.heartbeat.healthy and not self.stopping.is_set(),
        )

    def status(self) -> wire.Heartbeat:
        tally = self.tally
        return wire.Heartbeat(
            role="worker",
            id=self.id,
            started_ms=self.started_ms,
            beat_ms=clock.now_ms(),
            busy=self.loop.busy,
            batches_done=tally.batches_done,
            requests_done=tally.requests_done,
            delivered_rps=round(tally.delivered_rps(), 1),
            batch_ms=round(self.runner.times.full_batch_ms(self.settings.max_batch), 2),
            one_ms=round(self.runner.times.one_input_ms(), 2),
            draining=self.stopping.is_set(),
            model=self.backend.fingerprint,
            lacks=sorted(self.backend.lacks),
            upstream_down=self.watch.down,
            slots=self.settings.slots,
            token_weights=self.answers.token_weights.said(),
            warm_ms=self.warm_ms,
        )

    # -- running batches (the runner's; here for callers that hold a worker) --

    async def handle(self, data: bytes, running: Running | None = None) -> Finished:
        return await self.runner.handle(data, running)

    async def run_batch(self, batch: wire.Batch, data: bytes | None = None) -> Finished:
        return await self.runner.run_batch(batch, data)

    # -- life ----------------------------------------------------------------------

    async def warm_up(self) -> None:
        """Real calls before taking work: one that loads the model (a first
        call can be slow: weights, kernels; its own bound, not timed), then
        one input, a full batch of short inputs and one of long ones, timed:
        what the batch time and the hang timeout start from (batch_time.py)."""
        bound_ms = max(600_000, self.settings.hang_timeout_ms)
        await self.runner.call(["warm-up"], timeout_ms=bound_ms, record="")
        full = max(1, min(MAX_BATCH, self.settings.max_batch))
        for batch in (["warm up"], ["warm up"] * full):
            await self.runner.call(batch, timeout_ms=bound_ms, record="anchor")
        try:
            await self.runner.call([WARM_UP_INPUT] * full, timeout_ms=bound_ms, record="anchor")
        except BackendError as exc:
            if unanswered(exc):
                raise
            # (a model whose context is shorter: its batch time starts from the short ones)
            log.warning("worker.warm_up_long_inputs_failed", error=str(exc)[:300])
        log.info(
            "worker.warm",
            batch_ms=round(self.runner.times.full_batch_ms(self.settings.max_batch), 1),
            backend=self.backend.name,
        )

    async def _warm_up_once(self) -> None:
        """This process's one warm-up: run here, or adopted from the member
        that ran it. Meanwhile the worker says it is warming up (``up``
        waits for a stack whose workers do)."""
        shared = self.shared_warm_up
        async with shared.lock:
            if shared.failed is not None:
                raise Unusable(shared.failed)
            if shared.anchors is not None:
                self.runner.times.adopt(shared.anchors)
                return
            warm = asyncio.Event()
            saying = asyncio.create_task(self._say_warming(warm))
            try:
                await self.warm_up()
            finally:
                # (set, not cancelled: redis-py may turn a cancel into an error it raises)
                warm.set()
                await saying
            shared.anchors = self.runner.times.anchors

    async def _say_warming(self, warm: asyncio.Event) -> None:
        while not warm.is_set():
            with contextlib.suppress(*STORE_ERRORS):
                await self.queue.warming(clock.now_ms() + WARMING_SAID_MS)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(warm.wait(), WARMING_SAID_MS / 2500)
        with contextlib.suppress(*STORE_ERRORS):
            await self.queue.warming(None)

    async def _warm_up_when_up(self, stop: asyncio.Event) -> int:
        """The warm-up, once a remote backend's server answers: 0 when done,
        -1 if ``stop`` came first, ``EXIT_UNUSABLE`` if the backend failed
        it (a breach of the contract, or a server whose model is not what
        the backend needs: the log line says what). A server that answers
        404 is waited on as one that is down (its model may be loading)."""
        while await self.watch.wait_until_up(stop, "warm-up"):
            try:
                await self._warm_up_once()
                return 0
            except (BackendError, Unusable) as exc:
                if isinstance(exc, BackendError) and unanswered(exc):
                    continue  # (it went away again: wait for it)
                shared = self.shared_warm_up
                if shared.failed is None:  # (said once for the process)
                    shared.failed = str(exc)[:500]
                    log.error(
                        "worker.warm_up_failed", backend=self.backend.name, error=shared.failed
                    )
                return EXIT_UNUSABLE
        return -1

    async def _register(self) -> None:
        """Batches left under this id by an earlier life are recovered first."""
        outcomes = await self.recovery.recover_worker(self.id, self.settings.max_attempts)
        if outcomes:
            log.warning("worker.recovered_own_batches", outcomes=outcomes)
        # (warmed up, before any call: what the warm-up measured)
        self.warm_ms = round(self.runner.times.full_batch_ms(self.settings.max_batch), 2)
        await self._adopt_token_weights()
        await self.heartbeat.beat_once()
        await self.queue.offer_credit()

    async def _adopt_token_weights(self) -> None:
        """Begin from the token weights the workers of this model, as fast
        as this one, fitted (its first calls split as theirs). Best effort:
        a read that fails leaves it at one, as a worker alone."""
        try:
            beats, _ = await self.store.heartbeats(["worker"])
            readable = self.store.readable("worker", beats["worker"])
        except Exception as exc:  # (Redis away, a planted key: the start goes on)
            log.warning("worker.token_weights_unread", error=type(exc).__name__)
            return
        weights = self.answers.token_weights
        if weights.adopt(fleet_weights(readable, self.backend.fingerprint, self.warm_ms)):
            log.info(
                "worker.token_weights_adopted",
                new_token_weight=weights.per_token,
                step_weight=weights.per_step,
            )

    async def serve(self, stop: asyncio.Event) -> int:
        self.stopping = stop
        warm = await self._warm_up_when_up(stop)
        if warm != 0:
            await self._close()
            return 0 if warm < 0 else warm
        if not await retry_until_done("worker.register", self._register, stop):
            await self._close()
            return 0
        self.heartbeat.start()
        log.info("worker.started", worker_id=self.id)
        try:
            await self.loop.run(stop)
        finally:
            await self.heartbeat.stop()
            await retry_until_done("worker.retire", self._retire, stop, grace_after_stop_s=2.0)
            await self._close()
        log.info(
            "worker.stopped",
            worker_id=self.id,
            batches=self.tally.batches_done,
            requests=self.tally.requests_done,
        )
        return 0

    async def _close(self) -> None:
        await asyncio.to_thread(self.thread.close, 5.0)  # (its upstream: the process's to close)
        self._blocking_take.close()
        await self.store.close()

    async def _retire(self) -> None:
        if await self.queue.batch_in_hand() is not None:
            # Not answered (Redis was away past the grace): the heartbeat goes,
            # the membership stays, so the reaper finds this worker dead and
            # runs the batch again.
            log.warning("worker.left_a_batch", worker_id=self.id)
            await self.queue.leave(keep_membership=True)
            return
        await self.queue.leave()
        await self.queue.forget_last_step()

    async def exit_hung(self, event: str, **fields: object) -> NoReturn:
        """The backend's thread, which cannot be interrupted, is stuck: the
        last batch's answer, if still going out, is finished first (within
        the grace, while the heartbeat still says this worker holds it);
        then the worker exits at once, without acking, so what it holds
        stays in processing for the reaper."""
        log.error(event, **fields)
        if self.loop.answering is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.shield(self.loop.answering), self.settings.publish_grace_s
                )
        await self.heartbeat.stop()
        sys.stderr.flush()
        os._exit(EXIT_HUNG)

    def grace_left(self) -> float:
        """What is left of ``publish_grace_s`` once stopping: one grace,
        counted from when a failing step first saw the stop, for the take and
        the answers together (so the worker's shutdown grace still covers
        them)."""
        now = clock.monotonic_s()
        if self._stop_seen_at is None:
            self._stop_seen_at = now
        return max(0.0, self.settings.publish_grace_s - (now - self._stop_seen_at))
