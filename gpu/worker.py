"""A GPU worker: offer a credit, take one batch, run it, publish the replies.

The batch sits in ``processing:{worker}`` while it runs; it leaves only when
the replies have been published (``finish``). A worker that dies leaves its
batch there for the reaper. A backend call that fails is split in halves and
retried down to the single inputs that fail, so one poisoned input fails
only its own request. A call that runs past the hang timeout stops the
worker: it stops heartbeating and exits non-zero, so the batch is retried
elsewhere.
"""

import asyncio
import os
import sys
from collections import defaultdict, deque
from dataclasses import dataclass

import redis.exceptions

from dispatcher import wire
from dispatcher.broker import Broker, connect
from dispatcher.heartbeat import Heartbeater
from dispatcher.keys import Keys
from gpu.backend import Backend, BackendError
from infergate import clock, logs, tracing
from infergate.settings import ProcessSettings

log = logs.get(__name__)
_tracer = tracing.tracer(__name__)

EXIT_HUNG = 3


@dataclass(frozen=True)
class WorkerSettings(ProcessSettings):
    hang_timeout_ms: int = 5_000
    pull_timeout_s: float = 1.0
    max_batch_size: int = 100


class Worker:
    def __init__(self, settings: WorkerSettings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.id = settings.process_id
        self.redis = connect(
            settings.redis_url, block_s=settings.pull_timeout_s, name="worker:" + self.id
        )
        self.broker = Broker(self.redis, Keys(settings.namespace))
        self.started_ms = clock.now_ms()
        self.busy = False
        self.batches_done = 0
        self.requests_done = 0
        self.batch_ms_ewma: float | None = None
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic s, requests) per batch
        self.draining = False
        self.heartbeat = Heartbeater(
            self.broker, self.status, settings.heartbeat_interval_ms, settings.heartbeat_ttl_ms
        )

    # -- what the heartbeat says ---------------------------------------------

    def status(self) -> wire.Heartbeat:
        now = clock.monotonic_s()
        window_s = 5.0
        while self._recent and self._recent[0][0] < now - window_s:
            self._recent.popleft()
        delivered = sum(n for _, n in self._recent) / window_s
        capacity = (
            self.settings.max_batch_size * 1000.0 / self.batch_ms_ewma
            if self.batch_ms_ewma
            else 0.0
        )
        return wire.Heartbeat(
            role="worker",
            id=self.id,
            started_ms=self.started_ms,
            beat_ms=clock.now_ms(),
            busy=self.busy,
            batches_done=self.batches_done,
            requests_done=self.requests_done,
            delivered_rps=round(delivered, 1),
            capacity_rps=round(capacity, 1),
            batch_ms=round(self.batch_ms_ewma or 0.0, 2),
            draining=self.draining,
        )

    # -- running the backend -------------------------------------------------

    async def _call(self, inputs: list[str]) -> list[str]:
        """One backend call in a thread, bounded by the hang timeout."""
        started = clock.monotonic_s()
        call = asyncio.to_thread(self.backend.infer, inputs)
        try:
            outputs = await asyncio.wait_for(call, self.settings.hang_timeout_ms / 1000.0)
        except TimeoutError:
            log.error(
                "worker.hung", hang_timeout_ms=self.settings.hang_timeout_ms, size=len(inputs)
            )
            await self.heartbeat.stop()
            # The backend thread cannot be interrupted: leave at once, without
            # acking, so the batch stays in processing for the reaper.
            sys.stderr.flush()
            os._exit(EXIT_HUNG)
        took_ms = clock.elapsed_ms(started)
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
        live = [e for e in batch.envelopes if e.deadline_ms > started_ms]
        if len(live) < len(batch.envelopes):
            log.info(
                "batch.expired_skipped", batch_id=batch.id, count=len(batch.envelopes) - len(live)
            )
        if not live:
            return {}
        started = clock.monotonic_s()
        outcomes = await self._infer_isolating([e.input for e in live])
        infer_ms = round(clock.elapsed_ms(started))
        by_gateway: dict[str, list[wire.Result]] = defaultdict(list)
        failed = 0
        for env, outcome in zip(live, outcomes, strict=True):
            common = dict(
                id=env.id,
                batch_id=batch.id,
                batch_size=len(live),
                worker=self.id,
                queue_ms=max(0, started_ms - env.enqueued_ms),
                infer_ms=infer_ms,
            )
            if isinstance(outcome, BackendError):
                failed += 1
                error = wire.ErrorInfo(
                    "INFERENCE_FAILED", str(outcome)[:500] or "the backend failed"
                )
                by_gateway[env.gateway].append(wire.Result(**common, error=error))  # type: ignore[arg-type]
            else:
                by_gateway[env.gateway].append(wire.Result(**common, output=outcome))  # type: ignore[arg-type]
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
            gateways=len(by_gateway),
        )
        return {gw: wire.Reply(results) for gw, results in by_gateway.items()}

    # -- the loop ----------------------------------------------------------------

    async def warm_up(self) -> None:
        """One real call before taking work: loads the model and measures the batch time."""
        await self._call(["warm-up"])
        log.info(
            "worker.warm", batch_ms=round(self.batch_ms_ewma or 0.0, 1), backend=self.backend.name
        )

    async def serve(self, stop: asyncio.Event) -> int:
        await self.warm_up()
        backoff_s = 0.1
        while True:
            try:
                await self.heartbeat.beat_once()
                await self.broker.offer_credit(self.id)
                break
            except (redis.exceptions.RedisError, OSError) as exc:
                if stop.is_set():
                    return 0
                log.warning("worker.redis_unavailable", error=type(exc).__name__, retry_s=backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
        self.heartbeat.start()
        log.info("worker.started", worker_id=self.id)
        try:
            await self._loop(stop)
        finally:
            await self.heartbeat.stop()
            try:
                await self.broker.finish_idle(self.id)
                await self.broker.retire("worker", self.id)
            except (redis.exceptions.RedisError, OSError) as exc:
                log.warning("worker.retire_failed", error=type(exc).__name__)
            await self.redis.aclose()
        log.info(
            "worker.stopped",
            worker_id=self.id,
            batches=self.batches_done,
            requests=self.requests_done,
        )
        return 0

    async def _loop(self, stop: asyncio.Event) -> None:
        backoff_s = 0.1
        need_credit = False
        while not stop.is_set():
            try:
                if need_credit:
                    await self.broker.offer_credit(self.id)
                    need_credit = False
                data = await self.broker.pull_batch(self.id, self.settings.pull_timeout_s)
                backoff_s = 0.1
            except (redis.exceptions.RedisError, OSError) as exc:
                log.warning("worker.redis_unavailable", error=type(exc).__name__, retry_s=backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
                need_credit = True  # a restarted Redis lost our credit
                continue
            if data is None:
                try:
                    if await self.broker.ensure_credit(self.id):
                        log.warning("worker.credit_restored", worker_id=self.id)
                except (redis.exceptions.RedisError, OSError):
                    need_credit = True
                continue
            self.busy = True
            try:
                batch = wire.decode_batch(data)
                replies = await self.run_batch(batch)
            except Exception:
                log.exception("batch.unreadable")
                replies = {}
            self.draining = stop.is_set()
            await self._publish(replies, offer_credit=not stop.is_set(), stop=stop)
            self.busy = False

    async def _publish(
        self, replies: dict[str, wire.Reply], offer_credit: bool, stop: asyncio.Event
    ) -> None:
        """Publish and ack; retried while Redis is away, since the work is done."""
        backoff_s = 0.05
        for _ in range(40):
            try:
                await self.broker.publish_and_finish(self.id, replies, offer_credit)
                return
            except (redis.exceptions.RedisError, OSError) as exc:
                log.warning("batch.publish_failed", error=type(exc).__name__, retry_s=backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 1.0)
        log.error("batch.publish_gave_up")
