"""A process's view of the fleet: healthy workers, their measured batch time
and capacity, and the queue depth of each tier, refreshed in the background
several times a second (never a Redis round trip per request). Gateways use
it for readiness and admission, dispatchers for pacing.

Capacity is computed here and only here: a worker reports the batch time it
measures, and the fleet's capacity is ``max_batch_size / batch time`` summed
over the workers that take work (a draining worker does not), with the
batch size of the live policy.
"""

import asyncio
import time
from collections import deque
from collections.abc import Callable

from infergate.base import clock, logs, wire
from infergate.base.loops import Backoff, Supervised
from infergate.base.metrics import WORKER_STATES, FleetReading
from infergate.base.queue.store import FleetSnapshot, Store
from infergate.base.tiers import TIERS

log = logs.get(__name__)


def worker_capacity_rps(worker: wire.Heartbeat, max_batch_size: int) -> float:
    """The most one worker can deliver at the batch time it measured (0 if unknown)."""
    return max_batch_size * 1000.0 / worker.batch_ms if worker.batch_ms > 0 else 0.0


class ArrivalRates:
    """The rate at which each tier's requests were admitted, fleet-wide, over
    the last few seconds: each gateway's heartbeat carries its running count
    per tier; the rate is its growth between the oldest and newest beat kept."""

    WINDOW_MS = 2_000

    def __init__(self, ntiers: int) -> None:
        self._ntiers = ntiers
        self._beats: dict[str, deque[tuple[int, list[int]]]] = {}
        self.rps: list[float] = [0.0] * ntiers

    def update(self, gateways: list[wire.Heartbeat]) -> None:
        live = {g.id for g in gateways}
        for gone in set(self._beats) - live:
            del self._beats[gone]
        rps = [0.0] * self._ntiers
        for g in gateways:
            if len(g.admitted_by_tier) != self._ntiers:
                continue  # a gateway of an earlier version: unknown, counted as none
            beats = self._beats.setdefault(g.id, deque())
            if not beats or g.beat_ms > beats[-1][0]:
                beats.append((g.beat_ms, g.admitted_by_tier))
            while beats[-1][0] - beats[0][0] > self.WINDOW_MS:
                beats.popleft()
            (first_ms, first), (last_ms, last) = beats[0], beats[-1]
            if last_ms - first_ms >= 200:
                for i in range(self._ntiers):
                    rps[i] += max(0, last[i] - first[i]) * 1000.0 / (last_ms - first_ms)
        self.rps = rps


class FleetView:
    """The fleet as one process sees it, refreshed every ``refresh_ms``.
    With ``at_rest_ms``, every that long instead while nothing asks for it
    (and every ``serving_at_rest_ms`` while ``serving()``, by default while
    some worker of its own serves: a process that waits for its first
    worker reads as often as before); then ``fresh`` reads it at once for
    the first request that does (once for every request waiting on it), so
    no request is decided on a view older than ``refresh_ms``."""

    def __init__(
        self,
        store: Store,
        refresh_ms: int = 200,
        at_rest_ms: int | None = None,
        serving_at_rest_ms: int | None = None,
        serving: Callable[[], bool] | None = None,
    ) -> None:
        self.store = store
        self._busy_s = refresh_ms / 1000.0
        self._at_rest_s = self._busy_s if at_rest_ms is None else at_rest_ms / 1000.0
        self._serving_at_rest_s = (
            self._at_rest_s if serving_at_rest_ms is None else serving_at_rest_ms / 1000.0
        )
        self._serving_now = serving or (lambda: bool(self._serving))
        self._used = False  # asked for (``fresh``) since the last refresh
        self._read_at = 0.0  # when the last refresh ended, read or not (monotonic s)
        self._reading: asyncio.Future[None] | None = None
        self._snapshot: FleetSnapshot | None = None
        # Derived once per snapshot (a few times a second), read per request.
        self._serving: list[wire.Heartbeat] = []
        self._batch_ms = 0.0
        self._one_ms = 0.0
        # The slowest worker's batch time in the last view that had one.
        self.slowest_batch_ms = 0.0
        self._capacity: dict[int, float] = {}
        self._models: dict[str, str] = {}  # each worker's fingerprint
        self._lacks: frozenset[str] = frozenset()
        self.arrivals = ArrivalRates(len(TIERS))
        self.refreshed = asyncio.Event()
        refresh_s = refresh_ms / 1000.0
        self.loop = Supervised(
            "fleet-view", self.refresh, refresh_s, Backoff(base_s=refresh_s, cap_s=1.0)
        )

    @property
    def redis_ok(self) -> bool:
        """The last refresh succeeded, and nothing since said Redis was
        lost (at rest that refresh may be seconds old)."""
        return self.loop.healthy and self.snapshot is not None

    @property
    def snapshot(self) -> FleetSnapshot | None:
        return self._snapshot

    @snapshot.setter
    def snapshot(self, snapshot: FleetSnapshot | None) -> None:
        self._snapshot = snapshot
        self._serving = (
            []
            if snapshot is None
            else [w for w in snapshot.workers if not w.draining and not w.upstream_down]
        )
        self._lacks = _lacked_by_all(self._serving)
        if snapshot is not None:
            self.arrivals.update(snapshot.gateways)
        self._models = {} if snapshot is None else {w.id: w.model for w in snapshot.workers}
        times = [w.batch_ms for w in self._serving if w.batch_ms > 0]
        self._batch_ms = sum(times) / len(times) if times else 0.0
        if times:  # (kept through an outage, when no view can be read)
            self.slowest_batch_ms = max(times)
        ones = [
            w.one_ms if 0 < w.one_ms < w.batch_ms else w.batch_ms
            for w in self._serving
            if w.batch_ms > 0
        ]
        self._one_ms = sum(ones) / len(ones) if ones else 0.0
        self._capacity = {}

    def fingerprint(self) -> str | None:
        """The model every serving worker runs (None if they differ, or none
        serves): the result cache is read only for a fleet of one model."""
        models = {w.model for w in self._serving}
        return models.pop() if len(models) == 1 and "" not in models else None

    def fingerprint_of(self, worker_id: str) -> str | None:
        """The model a worker runs (None if it is not in the view)."""
        return self._models.get(worker_id)

    def serving(self) -> list[wire.Heartbeat]:
        """The workers that take work: alive, not draining, their server up."""
        return self._serving

    def lacks(self, feature: str) -> bool:
        """Every serving worker's backend lacks ``feature`` ("sampling",
        "max_tokens"): a request that needs it cannot be served."""
        return feature in self._lacks

    @property
    def workers_alive(self) -> int:
        return len(self._serving)

    def capacity_rps(self, max_batch_size: int) -> float:
        capacity = self._capacity.get(max_batch_size)
        if capacity is None:
            capacity = sum(worker_capacity_rps(w, max_batch_size) for w in self._serving)
            self._capacity[max_batch_size] = capacity
        return capacity

    def batch_ms(self) -> float:
        """Mean measured batch time of the serving workers (0 if unknown)."""
        return self._batch_ms

    def batch_of_ms(self, size: int, max_batch_size: int) -> float:
        """The expected time of a batch of ``size`` inputs: between a batch
        of one's and a full batch's, by size (the workers' fits are linear
        in the inputs)."""
        full, one = self._batch_ms, self._one_ms
        if size >= max_batch_size or max_batch_size <= 1 or one >= full:
            return full
        return one + (full - one) * (max(size, 1) - 1) / (max_batch_size - 1)

    def arrival_rps(self, tier: str) -> float:
        """Requests of ``tier`` admitted per second, fleet-wide, of late."""
        return self.arrivals.rps[TIERS.index(tier)]

    def mark_unreachable(self) -> None:
        """Redis did not answer (a request's call, or the reply listener's
        subscription broke): no view, so not ready, until a refresh
        succeeds, and the next one at the busy interval's next tick (a
        resting view would keep its last snapshot for seconds)."""
        self.snapshot = None
        self.loop.hasten(self._busy_s)

    async def refresh(self) -> None:
        try:
            self.snapshot = await self.store.fleet_snapshot(clock.now_ms())
        except BaseException:
            self.snapshot = None
            raise
        finally:
            self.refreshed.set()
            self._read_at = time.monotonic()
            self.loop.interval_s = (
                self._busy_s
                if self._used
                else self._serving_at_rest_s
                if self._serving_now()
                else self._at_rest_s
            )
            self._used = False

    async def fresh(self) -> None:
        """A request is about to be decided on the view: no older than
        ``refresh_ms`` (read now if it is, the refresh shared by every
        request that waits on it; one that fails leaves the view None,
        as the loop's would)."""
        self._used = True
        if time.monotonic() - self._read_at <= self._busy_s:
            return
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_now())
        await asyncio.shield(self._reading)

    async def _read_now(self) -> None:
        try:
            await self.refresh()
        except Exception:  # (the loop reports Redis's health; the view says not ready)
            pass
        finally:
            self._reading = None

    async def start(self) -> None:
        """Refresh once (so the first request sees the fleet), then keep refreshing."""
        try:
            await self.refresh()
            self.loop.healthy = True
        except Exception as exc:
            log.warning("fleet.first_refresh_failed", error=type(exc).__name__)
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()


def _lacked_by_all(workers: list[wire.Heartbeat]) -> frozenset[str]:
    if not workers:
        return frozenset()
    lacked = set(workers[0].lacks)
    for w in workers[1:]:
        lacked.intersection_update(w.lacks)
    return frozenset(lacked)


def fleet_reading(
    view: FleetView,
    max_batch_size: int,
    target_utilization: float,
    policy_version: str,
    latency_budget_s: dict[str, float],
) -> FleetReading | None:
    """What the fleet gauges say now (None before the first view)."""
    snapshot = view.snapshot
    if snapshot is None:
        return None
    states = dict.fromkeys(WORKER_STATES, 0)
    for w in snapshot.workers:
        state = "draining" if w.draining else "upstream_down" if w.upstream_down else None
        states[state or ("busy" if w.busy else "idle")] += 1
    return FleetReading(
        queue_depth=dict(snapshot.queue_depth),
        workers=states,
        capacity_rps=view.capacity_rps(max_batch_size) * target_utilization,
        estimated_wait_s={},
        policy_version=policy_version,
        latency_budget_s=latency_budget_s,
    )
