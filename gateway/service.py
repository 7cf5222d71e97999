"""A gateway process: its parts wired together (the Redis client, the reply
router, the fleet view, the policy in force), its life (start, stop, drain,
readiness) and who a caller is (``auth.py``). The request path (``inference.py``) and the
operators' endpoints (``operators.py``) work on it, and ``server.py`` puts
the three together.
"""

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import partial

from infergate.base import clock, logs, tracing
from infergate.base.errors import STORE_ERRORS, UNAVAILABLE, input_not_stored, out_of_memory
from infergate.base.fleet import fleet_reading
from infergate.base.keys import DEFAULT_MODEL
from infergate.base.loops import Supervised
from infergate.base.metrics import (
    FleetCollector,
    FleetReading,
    GatewayMetrics,
    watch_policy_and_redis,
)
from infergate.base.probes import Probes
from infergate.base.queue import shards
from infergate.base.queue.gateway import GatewayQueue
from infergate.base.queue.policy_copy import keep_policy
from infergate.base.queue.store import Store
from infergate.base.settings import ProcessSettings
from infergate.base.tiers import TIERS
from infergate.gateway.auth import Authenticator
from infergate.gateway.budgets import MARKS, BudgetWatch
from infergate.gateway.direct import DirectMode, MakeCall
from infergate.gateway.errors import ApiError, input_not_kept, redis_full, redis_unreachable
from infergate.gateway.holds import Holds
from infergate.gateway.jwks import KeySet
from infergate.gateway.limits import EdgeLimits
from infergate.gateway.models import Lanes, ModelLane
from infergate.gateway.quota import Quota
from infergate.gateway.redis_memory import RedisMemory
from infergate.gateway.replies import ReplyRouter
from infergate.gateway.shares import Shares
from infergate.policies import KeyEntry, Policy
from infergate.policies.live import LivePolicy
from prometheus_client import CollectorRegistry

log = logs.get(__name__)


@dataclass(frozen=True)
class GatewaySettings(ProcessSettings):
    # The fleet view behind admission: queue depths at most this old, plus what
    # this gateway admitted since. Short, so a burst is seen within a few batches.
    fleet_refresh_ms: int = 50


@dataclass(frozen=True)
class Shard:
    """One Redis primary of the deployment, as this gateway reaches it."""

    index: int
    name: str  # (its identity for the hash: shards.py)
    store: Store
    queue: GatewayQueue  # (the deployment's keys on it: replies, jobs)
    quota: Quota

    @classmethod
    def connect(cls, index: int, url: str, settings: GatewaySettings) -> "Shard":
        store = Store.connect(url, settings.namespace, name="gateway:" + settings.process_id)
        queue = GatewayQueue(store, settings.process_id)
        return cls(index, shards.identity(url), store, queue, Quota(queue))


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        policy: LivePolicy,
        max_connections: int = EdgeLimits.max_connections,
        direct_call: MakeCall = lambda name, model: None,
    ) -> None:
        """``direct_call``: the server a model's backend names, which this
        gateway calls itself in direct mode (``direct.py``; none: it fails fast)."""
        self.settings = settings
        self.holds = Holds(max_connections)
        self.id = settings.process_id
        self.policy = policy
        self.shards = [
            Shard.connect(i, url, settings) for i, url in enumerate(shards.urls(settings.redis_url))
        ]
        self._shard_names = [shard.name for shard in self.shards]
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.replies = ReplyRouter(
            [shard.queue for shard in self.shards],
            on_ignored=self.metrics.replies_ignored.inc,
            grace_s=self._running_batch_s,
            on_lost=self._redis_lost,
        )
        self.started_ms = clock.now_ms()
        self.lanes = Lanes(self._lane, self.id, len(self.shards), self.shard_index)
        policy.keep_with(self._keep_policy)
        policy.on_change(self.lanes.follow)
        watch_policy_and_redis(self.metrics, policy, self.redis_ok)
        # Read on the event loop once a second; the scrape thread only reads the result.
        self._readings: dict[str, FleetReading] = {}
        self.registry.register(FleetCollector(lambda: self._readings))
        self.metrics_reading = Supervised("metrics-reading", self._refresh_reading, 1.0)
        self.shares = Shares(
            lambda model, key_id: self.shard_of(key_id).store.of_model(model), self.metrics
        )
        self.shares_flush = Supervised("usage-refusals", self._flush_shares, 5.0)
        self.memory = RedisMemory(
            [shard.store for shard in self.shards],
            lambda: self.policy.current.document.limits.redis_memory_high_water,
            self.metrics.redis_memory_use,
            self.metrics.redis_memory_high_water,
        )
        self.direct = DirectMode(direct_call, self.id)
        self.budgets = BudgetWatch()
        for mark in MARKS:
            self.metrics.budget_keys.labels(f"{mark:g}").set_function(
                partial(self.budgets.keys_at, mark)
            )
        self.draining = False
        self.key_set = KeySet(policy)
        self.authenticator = Authenticator(self.key_set)

    def shard_index(self, key_id: str) -> int:
        return shards.shard_of(key_id, self._shard_names)

    def shard_of(self, key_id: str) -> Shard:
        """The shard that holds a key's quotas, queue places, jobs and usage."""
        return self.shards[shards.shard_of(key_id, self._shard_names)]

    def _lane(self, model: str, shard: int) -> ModelLane:
        settings = self.settings
        return ModelLane(
            model,
            shard,
            self.shards[shard].store.of_model(model),
            self.id,
            self.started_ms,
            (settings.fleet_refresh_ms, settings.heartbeat_interval_ms, settings.heartbeat_ttl_ms),
            self._handed_one,
            self.metrics.cache_bypassed.inc,
            lambda: self.workers_alive(shard) > 0,
        )

    def _handed_one(self) -> None:
        """A lone request handed straight to an idle worker: its batch was
        formed here (in the request's trace, where a dispatcher's span would be)."""
        self.metrics.forming.handed_one()
        tracing.event("handed_straight")

    def redis_ok(self, shard: int | None = None) -> bool:
        """Every model's fleet view was read, and lately, on ``shard`` (every
        shard when none is named: one Redis serves all of a shard's models)."""
        lanes = list(self.lanes) if shard is None else self.lanes.on_shard(shard)
        return bool(lanes) and all(lane.fleet.redis_ok for lane in lanes)

    def _running_batch_s(self) -> float:
        """How long a batch running now may take to answer: twice the
        slowest worker's batch time as last seen (Redis was just away: the
        view now is empty), and a second at least."""
        slowest_ms = max((lane.fleet.slowest_batch_ms for lane in self.lanes), default=0.0)
        return max(1.0, 2 * slowest_ms / 1000.0)

    def workers_alive(self, shard: int = 0) -> int:
        """The workers alive on ``shard`` (a worker serves every shard)."""
        return sum(lane.fleet.workers_alive for lane in self.lanes.on_shard(shard))

    def full(self, shard: int) -> bool:
        """``shard``'s Redis said it is out of memory, and has not said otherwise since."""
        return self.shards[shard].store.full

    def count_admitted(self, key: KeyEntry, lane: ModelLane) -> None:
        """A request was let in (charged and queued, or handed to a worker)."""
        lane.count_admitted(key)
        self.shares.admitted(key, lane.label)

    def count_refused(
        self, key: KeyEntry, reason: str, lane: ModelLane | None, for_capacity: bool = True
    ) -> None:
        """A request of ``key`` was refused at admission."""
        self.metrics.refusals.labels(key.tier, reason).inc()
        if for_capacity and lane is not None:
            lane.count_refused_for_capacity()
        self.shares.refused(key, lane.name if lane is not None else DEFAULT_MODEL)

    async def _flush_shares(self) -> None:
        retention_days = self.policy.current.document.usage.retention_days
        await self.shares.flush(round(retention_days * 86_400))

    async def _refresh_reading(self) -> None:
        self._end_direct_mode()
        readings = {}
        served = self.policy.current.models
        for lane in self.lanes:
            if lane.name not in served:  # dropped by the policy: no alert for its workers
                continue
            reading = self._fleet_reading(lane)
            if reading is not None:
                readings[lane.label] = reading
        self._readings = readings

    def _fleet_reading(self, lane: ModelLane) -> FleetReading | None:
        policy = self.policy.current.for_model(lane.name)
        doc = policy.document
        reading = fleet_reading(
            lane.fleet,
            doc.batching.max_batch_size,
            doc.capacity.target_utilization,
            policy.version,
            policy.latency_budgets_s(),
        )
        if reading is None:
            return None
        waits = {t: lane.admission.estimate_wait_ms(policy, t) / 1000.0 for t in TIERS}
        return dataclasses.replace(reading, estimated_wait_s=waits)

    def _end_direct_mode(self) -> None:
        """Each shard in direct mode whose Redis answers again goes back to
        the queue (its next requests are queued as before)."""
        for shard in list(self.direct.on_shards):
            if self.ready_for_replies(shard):
                self.direct.ended(shard)
        self.metrics.direct_mode.set(1 if self.direct.on_shards else 0)

    def can_serve_directly(self) -> bool:
        """Some tier may be served in direct mode, by some model's server."""
        policy = self.policy.current
        if not policy.document.direct.tiers:
            return False
        return any(self.direct.batcher(name, model) for name, model in policy.models.items())

    def ready_for_replies(self, shard: int) -> bool:
        """``shard``'s Redis answers, its fleet view is fresh, AND this gateway
        listens on its reply channel there: a request admitted while the
        subscription is down (after a Redis restart) would have its reply
        published to no one."""
        return self.redis_ok(shard) and self.replies.listening(shard)

    def ready_on(self, shard: int) -> bool:
        return (
            self.ready_for_replies(shard)
            and self.workers_alive(shard) > 0
            and not self.shards[shard].store.full
        )

    def ready(self) -> bool:
        """Takes requests now: on the fleet's clock, not draining, and on at
        least one shard ready for replies, with a worker alive and Redis not
        out of memory (a shard that is down refuses only its own keys), or
        with a shard's Redis unreachable, in direct mode."""
        if not clock.aligned() or self.draining:
            return False
        if any(self.ready_on(shard.index) for shard in self.shards):
            return True
        away = any(not self.ready_for_replies(shard.index) for shard in self.shards)
        return away and self.can_serve_directly()

    def store_failed(self, exc: BaseException, shard: int) -> ApiError:
        """The client's error for a call to ``shard``'s Redis that failed:
        Redis out of memory is its own state, said as such, and so is a long
        input that Redis did not keep (its request alone); otherwise it is
        unreachable (and, if it did not answer at all, that shard is not
        ready here until its fleet view reads it again)."""
        if out_of_memory(exc):
            self.shards[shard].store.saw_full()
            return redis_full()
        if input_not_stored(exc):
            return input_not_kept()
        if isinstance(exc, UNAVAILABLE):
            for lane in self.lanes.on_shard(shard):
                lane.fleet.mark_unreachable()
        return redis_unreachable()

    def _redis_lost(self, shard: int) -> None:
        """The reply listener lost ``shard``'s Redis: its views read as
        none (not ready; a request there may be served directly) until
        one reads it again, rather than what they last read."""
        for lane in self.lanes.on_shard(shard):
            lane.fleet.mark_unreachable()

    def edge_failed(self, cause: str) -> None:
        """The edge could not read a request through what looks like its own
        fault (logged there, with the cause): counted, for an alert."""
        self.metrics.edge_faults.inc()

    def probes(self) -> Probes:
        return Probes(alive=self.alive, ready=self.ready)

    def alive(self) -> bool:
        """Every model's heartbeat still ends its beats: the event loop is not stuck."""
        return all(lane.heartbeat.alive() for lane in self.lanes)

    async def _keep_policy(self, policy: Policy, text: str) -> None:
        failed: list[BaseException] = []
        for shard in self.shards:  # (every shard that answers keeps it)
            try:
                await keep_policy(shard.store, policy.version, text)
            except STORE_ERRORS as exc:
                log.warning("policy.keep_failed", shard=shard.index, error=type(exc).__name__)
                failed.append(exc)
        # Kept while one shard has it: a shard that is down must not stop
        # the policy's changes (a revoked key) reaching the others.
        if len(failed) == len(self.shards):
            raise failed[0]

    async def start(self) -> None:
        if self.policy.error is None:
            try:
                await self.policy.keep()
            except STORE_ERRORS as exc:
                log.warning("policy.keep_failed", error=type(exc).__name__)
        self.policy.start()
        await self.lanes.start(self.policy.current)
        await self.key_set.start()
        await self.replies.start()
        self.metrics_reading.start()
        self.shares_flush.start()
        self.memory.loop.start()
        log.info("gateway.started", gateway_id=self.id, policy_version=self.policy.current.version)

    def authenticate(self, authorization: str | None, policy: Policy) -> KeyEntry:
        """The caller (``auth.py``), or 401/403."""
        return self.authenticator.authenticate(authorization, policy)

    async def stop(self) -> None:
        await self.metrics_reading.stop()
        await self.shares_flush.stop()
        await self.memory.loop.stop()
        await self.key_set.stop()
        with contextlib.suppress(*STORE_ERRORS):  # (the last refusals counted)
            await self._flush_shares()
        await self.policy.stop()
        await self.replies.stop()
        await self.lanes.started()
        for lane in self.lanes:
            try:
                await lane.stop(self.id)
            except STORE_ERRORS as exc:
                log.warning("gateway.retire_failed", model=lane.name, error=type(exc).__name__)
        for shard in self.shards:
            await shard.store.close()
        log.info("gateway.stopped", gateway_id=self.id)
