"""The dispatcher: forms a batch only when a worker can take it.

Loop: hold an idle worker's credit, then ``take``: up to ``max_batch_size``
envelopes in priority order, handed off as one batch in the same step.
Forming batches at the last moment means a free-tier batch is never frozen
ahead of an enterprise request that arrives a millisecond later. With
nothing waiting at all, the take puts the credit back onto ``ready`` and the
dispatcher waits on the doorbell holding nothing: a request that then finds
nothing queued goes straight from its gateway to that idle worker
(``hand_straight.lua``), and at rest the dispatcher makes no calls but its
waits. Waiting so, it holds nothing its death would leave: its heartbeat
rests, and comes back to the short TTL before the next credit is held.

Pacing (on by default): while less than a full batch waits, hand-offs are
spaced at least ``batch time / workers`` apart across the fleet. Without
it, workers that all take a batch of one within a few ms of each other are
then all busy together, and the next arrivals wait most of a batch time
(measured: p50 127 ms at 100 req/s with 4 workers at 100 ms). Paced, the
workers start evenly staggered and a request waits at most about one
interval. A full batch is never held back.

Every step is safe to interrupt: a dispatcher holds nothing but the credit
it waits with (envelopes go from their queues into a batch in one step),
that credit is in Redis under its id, and ``requeue`` returns it on stop, or
the reaper does if the dispatcher dies.
"""

import asyncio
import time
from dataclasses import dataclass

import msgspec
from infergate.base import clock, logs, tracing, wire
from infergate.base.fleet import FleetView, fleet_reading
from infergate.base.heartbeat import Heartbeater
from infergate.base.loops import Supervised, retry_until_done
from infergate.base.metrics import (
    DispatcherMetrics,
    FleetCollector,
    FleetReading,
    watch_policy_and_redis,
)
from infergate.base.probes import Probes
from infergate.base.queue.dispatcher import DispatcherQueue
from infergate.base.queue.forming import Rule, TakeResult, log_drops, new_batch_id
from infergate.base.queue.policy_copy import keep_policy
from infergate.base.queue.recovery import RecoveryQueue
from infergate.base.queue.store import Store
from infergate.base.settings import ProcessSettings
from infergate.base.tiers import TIERS
from infergate.dispatcher.reaper import Reaper
from infergate.dispatcher.scaling import ScaleSignalLoop
from infergate.policies import Policy
from infergate.policies.live import LivePolicy
from prometheus_client import CollectorRegistry

log = logs.get(__name__)
_tracer = tracing.tracer(__name__)


def _trace_of(envelope: bytes) -> str | None:
    try:
        return wire.decode_envelope(envelope).trace
    except msgspec.DecodeError:
        return None


# How often the batching rule is published for the workers (it holds for
# forming.RULE_TTL_MS).
RULE_REFRESH_S = 1.0


@dataclass(frozen=True)
class BatchRule:
    """What the policy says about forming batches (re-read for every batch)."""

    max_batch_size: int = 100
    min_slots: tuple[int, ...] = (0,) * len(TIERS)
    pacing: bool = True
    jobs_headroom: int = 1

    @classmethod
    def from_policy(cls, policy: Policy) -> "BatchRule":
        return cls(
            max_batch_size=policy.document.batching.max_batch_size,
            min_slots=tuple(policy.reserved_slots(t) for t in TIERS),
            pacing=policy.document.batching.pacing,
            jobs_headroom=policy.document.jobs.headroom_workers,
        )


# Holding nothing, the doorbell is waited on for this many block timeouts,
# in one wait (each wait that ends wakes the dispatcher and Redis), before
# the queues are looked at again: what that look finds (work whose ring a
# dispatcher took with it as it died) waits no longer than that, and any
# request admitted meanwhile rings again.
AT_REST_WAITS = 4


@dataclass(frozen=True)
class DispatcherSettings(ProcessSettings):
    block_timeout_s: float = 0.5


class Dispatcher:
    def __init__(self, settings: DispatcherSettings, policy: LivePolicy) -> None:
        self.settings = settings
        self.id = settings.process_id
        self.policy = policy
        self.rule = BatchRule.from_policy(policy.current)
        policy.on_change(self._policy_changed)
        policy.keep_with(self._keep_policy)
        self.store = Store.connect(
            settings.redis_url,
            settings.namespace,
            block_s=settings.block_timeout_s,
            name="dispatcher:" + self.id,
            model=settings.model,
        )
        self.queue = DispatcherQueue(self.store, self.id)
        self.registry = CollectorRegistry()
        self.metrics = DispatcherMetrics(self.registry)
        self.started_ms = clock.now_ms()
        self.batches_formed = 0
        # (at rest: as often as a heartbeat can expire; a take reads it fresh)
        self.fleet = FleetView(
            self.store, refresh_ms=200, at_rest_ms=max(200, settings.heartbeat_ttl_ms)
        )
        self.reaper = Reaper(
            RecoveryQueue(self.store, self.id),
            lambda: self.policy.current.document.workers.max_attempts,
            self.metrics,
        )
        watch_policy_and_redis(self.metrics, policy, lambda: self.fleet.redis_ok)
        # Read on the event loop once a second; the scrape thread only reads the result.
        self._reading: FleetReading | None = None
        self.registry.register(FleetCollector(self._readings))
        self.metrics_reading = Supervised("metrics-reading", self._refresh_reading, 1.0)
        # Waiting at rest it holds nothing (no credit): its beat rests then.
        self.at_rest = False
        self.heartbeat = Heartbeater(
            self.store,
            self.status,
            settings.heartbeat_interval_ms,
            settings.heartbeat_ttl_ms,
            rests=True,
            holds=lambda: not self.at_rest,
        )
        self.dispatching = Supervised("dispatch", self.dispatch_once, 0)
        # Workers form their next batch themselves by the rule published here.
        self.rule_publishing = Supervised("batch-rule", self._publish_rule, RULE_REFRESH_S)
        self.scale_signal = ScaleSignalLoop(self.store, self.fleet, self.id, policy, self.metrics)
        self._unsure = False

    def status(self) -> wire.Heartbeat:
        return wire.Heartbeat(
            role="dispatcher",
            id=self.id,
            started_ms=self.started_ms,
            beat_ms=clock.now_ms(),
            batches_done=self.batches_formed,
        )

    def probes(self) -> Probes:
        return Probes(
            alive=self.heartbeat.alive,
            ready=lambda: self.heartbeat.healthy and self.fleet.redis_ok,
        )

    def _readings(self) -> dict[str, FleetReading]:
        reading = self._reading
        return {} if reading is None else {self.settings.model: reading}

    async def _refresh_reading(self) -> None:
        self._reading = self._fleet_reading()

    def _fleet_reading(self) -> FleetReading | None:
        policy = self.policy.current
        doc = policy.document
        return fleet_reading(
            self.fleet,
            doc.batching.max_batch_size,
            doc.capacity.target_utilization,
            policy.version,
            policy.latency_budgets_s(),
        )

    def _policy_changed(self, policy: Policy) -> None:
        self.rule = BatchRule.from_policy(policy)

    async def _keep_policy(self, policy: Policy, text: str) -> None:
        await keep_policy(self.store, policy.version, text)

    def pacing_interval_ms(self, rule: BatchRule) -> int:
        """Hand-offs spaced a batch time over the workers apart, to stagger
        backends that run one batch at a time; none for workers that keep
        several in flight (``--concurrency``: an engine that batches by
        itself takes a request whenever it comes)."""
        workers = self.fleet.workers_alive
        batch_ms = self.fleet.batch_ms()
        if not rule.pacing or workers < 2 or batch_ms <= 0:
            return 0
        if any(w.slots > 1 for w in self.fleet.serving()):
            return 0
        return int(batch_ms / workers)

    async def dispatch_once(self) -> None:
        """Wait (bounded) for an idle worker's credit; holding one, form a batch.

        After any failure, what this dispatcher may hold in Redis (a credit
        whose BLMOVE reply was lost, envelopes a lost ``take`` reply moved) is
        returned first, so nothing is held by no one, and a later take cannot
        pile envelopes onto forgotten ones."""
        if self._unsure:
            await self.queue.requeue_own()
            self._unsure = False
        await self.heartbeat.before_holding()
        self._unsure = True
        credit = await self.queue.wait_credit(self.settings.block_timeout_s)
        if credit is not None:
            await self.form_one(credit)
        self._unsure = False

    def forming_rule(self) -> Rule:
        """The batching rule now: the policy's, and the pacing interval the fleet gives."""
        rule = self.rule
        return Rule(
            n=rule.max_batch_size,
            interval_ms=self.pacing_interval_ms(rule),
            headroom=rule.jobs_headroom,
            min_slots=rule.min_slots,
        )

    async def _publish_rule(self) -> None:
        await self.queue.publish_rule(self.forming_rule())

    async def form_one(self, credit: str) -> None:
        """Holding ``credit``, wait for work and hand off one batch; with
        nothing waiting at all, the take gives the credit back and this
        waits on the doorbell holding nothing (``_wait_at_rest``)."""
        await self.fleet.fresh()  # (the pacing interval is the fleet's)
        while True:
            batch_id = new_batch_id()
            started_ns = time.time_ns()
            taken = await self.queue.take(
                credit,
                batch_id,
                clock.now_ms(),
                self.forming_rule(),
                with_envelopes=tracing.enabled,
            )
            if taken.worker_gone:
                await self.queue.drop_credit(credit)
                log.info("credit.worker_gone", credit=credit)
                return
            if taken.credit_lost:
                # (the reaper returned it, or its worker took it to join a
                # call of another shard's batch: gate.py)
                log.debug("credit.taken_back", credit=credit)
                return
            if taken.wait_ms > 0:
                await asyncio.sleep(taken.wait_ms / 1000.0)
                continue
            self.metrics.forming.count(taken)
            log_drops(taken)
            if taken.size > 0:
                self._formed(credit, batch_id, taken, started_ns)
                return
            if taken.offered:  # (nothing waits: the credit is back on ready)
                await self._wait_at_rest()
                return
            await self.queue.wait_doorbell(self.settings.block_timeout_s)

    async def _wait_at_rest(self) -> None:
        self.at_rest = True
        try:
            await self.queue.wait_doorbell(self.settings.block_timeout_s * AT_REST_WAITS)
        finally:
            self.at_rest = False

    def _formed(self, credit: str, batch_id: str, taken: TakeResult, started_ns: int) -> None:
        self.batches_formed += 1
        log.debug("batch.formed", batch_id=batch_id, size=taken.size, credit=credit)
        if tracing.enabled:
            # The batch-forming step as a span, linked to every request it carries.
            span = _tracer.start_span(
                "dispatcher.batch",
                links=tracing.links([_trace_of(e) for e in taken.envelopes]),
                start_time=started_ns,
            )
            span.set_attribute("infergate.batch_id", batch_id)
            span.set_attribute("infergate.batch_size", taken.size)
            span.set_attribute("infergate.credit", credit)
            span.end()

    async def _register(self) -> None:
        """Anything left by an earlier life under this id goes back first."""
        await self.queue.requeue_own()
        await self.heartbeat.beat_once()
        if self.policy.error is None:
            await self.policy.keep()

    async def serve(self, stop: asyncio.Event) -> int:
        if not await retry_until_done("dispatcher.register", self._register, stop):
            await self.store.close()
            return 0
        self.heartbeat.start()
        self.policy.start()
        await self.fleet.start()
        self.reaper.start()
        self.dispatching.start()
        self.rule_publishing.start()
        self.metrics_reading.start()
        self.scale_signal.start()
        log.info("dispatcher.started", dispatcher_id=self.id)
        try:
            await stop.wait()
        finally:
            await self.dispatching.stop()
            await self.rule_publishing.stop()
            await self.scale_signal.stop()
            await self.metrics_reading.stop()
            await self.reaper.stop()
            await self.heartbeat.stop()
            await self.policy.stop()
            await self.fleet.stop()
            await retry_until_done("dispatcher.retire", self._retire, stop, grace_after_stop_s=2.0)
            await self.store.close()
        return 0

    async def _retire(self) -> None:
        envs, credits = await self.queue.requeue_own()
        await self.store.retire("dispatcher", self.id)
        log.info("dispatcher.stopped", requeued=envs, credits_returned=credits)
