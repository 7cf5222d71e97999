"""The dispatcher's share of autoscaling: once a second, compute the signal
from the fleet's heartbeats (base/autoscale.py), as the dispatcher's fleet
view last read them (a read of its own only if that view is older than
``FRESH_MS``: a heartbeat TTL above the default rests the view longer),
export it as metrics and keep it in Redis for ``infergate up``."""

import msgspec
from infergate.base import clock, logs
from infergate.base.autoscale import Autoscaler
from infergate.base.fleet import FleetView
from infergate.base.loops import Backoff, Supervised
from infergate.base.metrics import DispatcherMetrics
from infergate.base.queue import scale_signal
from infergate.base.queue.store import Store
from infergate.policies.live import LivePolicy

log = logs.get(__name__)

INTERVAL_S = 1.0
# The view reads on the same one-second grid: its last read is a second old.
FRESH_MS = 1_500


class ScaleSignalLoop:
    def __init__(
        self,
        store: Store,
        fleet: FleetView,
        dispatcher_id: str,
        policy: LivePolicy,
        metrics: DispatcherMetrics,
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.dispatcher_id = dispatcher_id
        self.policy = policy
        self.metrics = metrics
        self.autoscaler = Autoscaler()
        self.loop = Supervised("scale-signal", self.step, INTERVAL_S, Backoff(0.2, INTERVAL_S))

    async def step(self) -> None:
        now_ms = clock.now_ms()
        snapshot = self.fleet.snapshot
        if snapshot is None or now_ms - snapshot.taken_ms > FRESH_MS:
            snapshot = await self.store.fleet_snapshot(now_ms)
        doc = self.policy.current.document
        signal = self.autoscaler.signal(
            snapshot.gateways,
            snapshot.workers,
            doc.batching.max_batch_size,
            doc.autoscale.target_utilization,
            now_ms,
        )
        if signal is None:
            return
        peak = await scale_signal.hold_peak(
            self.store,
            self.dispatcher_id,
            signal.desired_workers,
            now_ms,
            round(doc.autoscale.scale_down_after_s * 1000),
        )
        signal = msgspec.structs.replace(signal, desired_workers=peak)
        model = self.store.keys.model
        self.metrics.desired_workers.labels(model).set(signal.desired_workers)
        self.metrics.demand_rps.labels(model).set(signal.demand_rps)
        self.metrics.worker_capacity_rps.labels(model).set(signal.worker_capacity_rps)
        await scale_signal.publish(self.store, signal)

    def start(self) -> None:
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
