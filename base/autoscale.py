"""The autoscaling signal: how many workers the fleet needs.

GPU fleets scale on demand, up fast and down slowly (a cold start takes
minutes). Demand is what the gateways were asked to serve: requests they
admitted plus those refused for capacity (the fleet would have served them
had it been bigger), read from the cumulative counts in their heartbeats,
so it costs no Redis command per request. Capacity is what each worker
measured (``fleet.worker_capacity_rps``). Then

    desired = ceil(demand / (per-worker capacity x target utilization))

held at its highest over the policy's ``autoscale.scale_down_after_s`` (in
Redis, ``queue/scale_signal.py``, so every dispatcher holds the same peak
and a restarted one forgets nothing): it rises within a few seconds of a
surge and falls only after a quiet period.
``infergate up --workers MIN:MAX``, a HorizontalPodAutoscaler or a KEDA
ScaledObject follow it; this module only computes it.
"""

import math
from collections import deque

from infergate.base import wire
from infergate.base.fleet import worker_capacity_rps

DEMAND_WINDOW_S = 1.0
# Sanity bounds: a forged or corrupt heartbeat must not ask for a billion workers.
MAX_GATEWAY_RPS = 1_000_000.0
MAX_WORKERS = 10_000


class DemandMeter:
    """Requests per second asked of the gateways, over the last few seconds.

    Each gateway's rate is its count's change between two of its own beats,
    over their own timestamps: a late or missed beat shifts the window, it
    does not read as a dip in demand."""

    def __init__(self, window_s: float = DEMAND_WINDOW_S) -> None:
        self.window_ms = window_s * 1000.0
        self._beats: dict[str, deque[tuple[int, int]]] = {}  # id -> (beat_ms, count)

    def observe(self, gateways: list[wire.Heartbeat]) -> float | None:
        """Record the gateways' latest beats; the demand over the window
        (None until some gateway has beaten twice). A gateway gone from the
        fleet is forgotten; one just started counts from its second beat."""
        seen = {g.id for g in gateways}
        for gone in [g for g in self._beats if g not in seen]:
            del self._beats[gone]
        rate, measured = 0.0, False
        for g in gateways:
            beats = self._beats.setdefault(g.id, deque())
            if not beats or g.beat_ms > beats[-1][0]:
                beats.append((g.beat_ms, g.admitted + g.refused))
            while len(beats) > 2 and beats[1][0] <= g.beat_ms - self.window_ms:
                beats.popleft()
            (then_ms, before), (now_ms, after) = beats[0], beats[-1]
            if now_ms > then_ms:
                one = max(0, after - before) * 1000.0 / (now_ms - then_ms)
                rate += min(one, MAX_GATEWAY_RPS)
                measured = True
        return rate if measured else None


def per_worker_capacity_rps(workers: list[wire.Heartbeat], max_batch_size: int) -> float:
    """The mean measured capacity of a worker process that takes work (0 if
    none has measured): a process of N slots (``--concurrency``) beats once
    a slot, and serves N slots' worth."""
    measured = [
        worker_capacity_rps(w, max_batch_size) * max(1, w.slots)
        for w in workers
        if not w.draining and w.batch_ms > 0
    ]
    return sum(measured) / len(measured) if measured else 0.0


def workers_needed(demand_rps: float, capacity_rps: float, target_utilization: float) -> int:
    if demand_rps <= 0:
        return 0
    return min(MAX_WORKERS, math.ceil(demand_rps / (capacity_rps * target_utilization) - 1e-9))


class Autoscaler:
    """Turns heartbeats into a ``ScaleSignal`` (before its hold), once a second or so."""

    def __init__(self) -> None:
        self.demand = DemandMeter()
        self._capacity_rps = 0.0  # the last measured: kept while no worker reports one

    def signal(
        self,
        gateways: list[wire.Heartbeat],
        workers: list[wire.Heartbeat],
        max_batch_size: int,
        target_utilization: float,
        now_ms: int,
    ) -> wire.ScaleSignal | None:
        """None until demand and a worker's capacity have both been measured."""
        demand = self.demand.observe(gateways)
        capacity = per_worker_capacity_rps(workers, max_batch_size) or self._capacity_rps
        self._capacity_rps = capacity
        if demand is None or capacity <= 0:
            return None
        needed = workers_needed(demand, capacity, target_utilization)
        return wire.ScaleSignal(
            desired_workers=needed,
            demand_rps=round(demand, 1),
            worker_capacity_rps=round(capacity, 1),
            target_utilization=target_utilization,
            workers=round(sum(1 / max(1, w.slots) for w in workers if not w.draining)),
            at_ms=now_ms,
        )
