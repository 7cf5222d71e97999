"""What a gateway keeps for each model it serves (a *lane*): the model's key
space, its fleet view and admission, its cache and collapsing, and what this
gateway admitted to it, which its heartbeat in that space carries (the
model's arrival rates and demand: its own admission and autoscaling signal).

Every model of the policy has a lane from the gateway's start, or from the
policy that first lists it; a model a new policy drops loses its lane (its
fleet view and heartbeat stop; a request already on its way is answered).
On a deployment of several Redis shards a model has a lane on each, and a
request takes the one on its key's shard (``base/queue/shards.py``).
"""

from collections.abc import Callable, Iterator

from infergate.base import clock, logs, wire
from infergate.base.fleet import FleetView
from infergate.base.heartbeat import REST, Heartbeater
from infergate.base.loops import Background
from infergate.base.queue.gateway import GatewayQueue
from infergate.base.queue.store import Store
from infergate.base.tiers import TIERS
from infergate.gateway.admission import Admission
from infergate.gateway.errors import ApiError
from infergate.gateway.quota import Quota
from infergate.gateway.sharing import Cache, Collapsing
from infergate.policies import KeyEntry, Policy

log = logs.get(__name__)


class ModelLane:
    """What a gateway keeps for one model of the policy (its lane)."""

    def __init__(
        self,
        name: str,
        shard: int,
        store: Store,
        gateway_id: str,
        started_ms: int,
        beats: tuple[int, int, int],
        on_handed: Callable[[], None],
        on_cache_bypassed: Callable[[], None],
        serving: Callable[[], bool],
    ) -> None:
        """``serving``: some worker of some model serves on this shard (the
        gateway is ready there)."""
        fleet_refresh_ms, interval_ms, ttl_ms = beats
        self.name = name
        self.shard = shard
        # The model, and its shard's index on a deployment of several (in
        # metrics and the fair share's recent keys: a key competes on its shard).
        self.label = name if shard == 0 else f"{name}@{shard}"
        self.store = store
        self.queue = GatewayQueue(store, gateway_id, on_handed)
        # (at rest: as often as a heartbeat it reads can expire, and while
        # the gateway is ready on the shard, as often as the lane's resting
        # beat: for readiness and the gauges alone; a request reads it
        # fresh first: FleetView.fresh)
        at_rest_ms = max(fleet_refresh_ms, ttl_ms)
        self.fleet = FleetView(store, fleet_refresh_ms, at_rest_ms, at_rest_ms * REST, serving)
        self.quota = Quota(self.queue, lambda: self.fleet.slowest_batch_ms)
        self.cache = Cache(self.queue, on_cache_bypassed)
        self.collapsing = Collapsing()
        self.served = 0
        # Demand, for admission (the tiers' arrival rates: fleet.py) and the
        # model's autoscaling signal: admitted, and refused for capacity.
        self.admitted = 0
        self.admitted_by_tier = [0] * len(TIERS)
        self.refused_for_capacity = 0
        self.admission = Admission(self.fleet, lambda: self.admitted_by_tier)
        self.heartbeat = Heartbeater(
            store,
            lambda: wire.Heartbeat(
                "gateway",
                gateway_id,
                started_ms,
                clock.now_ms(),
                requests_done=self.served,
                admitted=self.admitted,
                refused=self.refused_for_capacity,
                admitted_by_tier=self.admitted_by_tier,
            ),
            interval_ms,
            ttl_ms,
            rests=True,  # (a gateway that dies leaves nothing to recover)
        )

    def count_admitted(self, key: KeyEntry) -> None:
        self.admitted += 1
        self.admitted_by_tier[TIERS.index(key.tier)] += 1
        self.heartbeat.stir()

    def count_refused_for_capacity(self) -> None:
        self.refused_for_capacity += 1
        self.heartbeat.stir()

    async def start(self) -> None:
        await self.fleet.start()
        self.heartbeat.start()
        log.info("gateway.model_started", model=self.name)

    async def stop(self, gateway_id: str) -> None:
        await self.heartbeat.stop()
        await self.fleet.stop()
        await self.store.retire("gateway", gateway_id)


class Lanes:
    """The gateway's lanes, by model name (one per shard), and which one a request takes."""

    def __init__(
        self,
        make: Callable[[str, int], ModelLane],
        gateway_id: str,
        shards: int = 1,
        shard_of: Callable[[str], int] = lambda key_id: 0,
    ) -> None:
        self._make = make
        self._gateway_id = gateway_id
        self._shards = shards
        self._shard_of = shard_of
        self.by_name: dict[str, list[ModelLane]] = {}
        self._starting = Background("gateway.model_lane_failed", "warning")

    def __iter__(self) -> Iterator[ModelLane]:
        # (a copy: a policy change may edit it)
        return iter([lane for lanes in list(self.by_name.values()) for lane in lanes])

    def on_shard(self, shard: int) -> list[ModelLane]:
        return [lanes[shard] for lanes in list(self.by_name.values())]

    def _made(self, name: str) -> list[ModelLane]:
        lanes = self.by_name[name] = [self._make(name, i) for i in range(self._shards)]
        return lanes

    async def start(self, policy: Policy) -> None:
        for name in policy.models:
            if name not in self.by_name:  # (a policy change may have made it already)
                for lane in self._made(name):
                    await lane.start()

    async def started(self) -> None:
        """Every lane a policy change began is started (before they stop)."""
        await self._starting.settled()

    def follow(self, policy: Policy) -> None:
        """A new policy: a lane for each model it lists first (started in
        the background; its first requests see no worker until its fleet
        view is read, a refresh away), none for a model it no longer lists."""
        for name in policy.models:
            if name not in self.by_name:
                for lane in self._made(name):
                    self._starting.run(lane.start())
        for name in [n for n in self.by_name if n not in policy.models]:
            for lane in self.by_name.pop(name):
                self._starting.run(lane.stop(self._gateway_id))

    def route(self, policy: Policy, key: KeyEntry, model: str | None) -> ModelLane:
        """The lane of the model a request names (the policy's default when it
        names none), on the key's shard: 404 for a model the policy does not
        list, 403 for one this key may not use."""
        name = policy.default_model if model is None else model
        if name not in policy.models:
            raise ApiError(
                "MODEL_NOT_FOUND",
                f"no model {name[:80]!r}; GET /v1/models lists the models this key may use",
                param="model",
            )
        if not policy.may_use(key, name):
            raise ApiError("FORBIDDEN", f"this key may not use the model {name!r}", param="model")
        lanes = self.by_name.get(name)
        if lanes is None:  # listed by a policy this instant; its lane is on its way
            self.follow(policy)
            lanes = self.by_name[name]
        return lanes[self._shard_of(key.id)]

    def of_key(self, name: str, key_id: str) -> ModelLane | None:
        """The lane a key's requests for model ``name`` take; None for a
        model not served here (no more, or a name read from Redis)."""
        lanes = self.by_name.get(name)
        return None if lanes is None else lanes[self._shard_of(key_id)]

    def named(self, policy: Policy, model: str | None, shard: int = 0) -> ModelLane:
        """An operator's view of one model (the default when none is named) on one shard."""
        name = policy.default_model if model is None else model
        lanes = self.by_name.get(name)
        if lanes is None:
            raise ApiError("MODEL_NOT_FOUND", f"no model {name[:80]!r} is served here")
        if not 0 <= shard < len(lanes):
            raise ApiError("NOT_FOUND", f"no shard {shard}: the shards here are 0-{len(lanes) - 1}")
        return lanes[shard]
