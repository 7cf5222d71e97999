"""Capacity-adaptive admission: say no at the door when the work queued
ahead of a request cannot be served within its tier's latency budget.

Fleet capacity is measured, not configured: each worker reports in its
heartbeat the batch time it measures, so capacity is
``sum(max_batch / batch_time)`` over the workers that take work (a
draining one does not; see ``infergate.base.fleet``), planned at the
policy's target utilization. The work ahead of a request is the queue depth
of its own and higher tiers (the fleet view, refreshed in the background)
plus what this gateway has admitted since that view was taken, divided by
capacity. That holds while the tiers above leave room. Once they queue a
full batch, a tier with a minimum batch share is counted only on the slots
it reserves in every batch (a guaranteed rate, so the estimate errs on the
safe side); a tier without one is refused once as much is queued above it
as the fleet can start in one batch time (and at least a full batch). When
workers die,
capacity drops within a heartbeat TTL and admission tightens by itself.
"""

from dataclasses import dataclass

from infergate.base.fleet import FleetView
from infergate.base.tiers import TIERS
from infergate.policies import Policy


@dataclass(frozen=True)
class Decision:
    admitted: bool
    wait_ms: float
    retry_after_ms: int = 0


class Admission:
    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet
        self._snapshot_seen: object = None
        self._admitted_since: dict[str, int] = dict.fromkeys(TIERS, 0)

    def capacity_rps(self, policy: Policy) -> float:
        """Planned capacity: measured (serving workers only) x target utilization."""
        measured = self.fleet.capacity_rps(policy.document.batching.max_batch_size)
        return measured * policy.document.capacity.target_utilization

    def _sync(self) -> None:
        """A new fleet view already counts what was admitted before it."""
        snapshot = self.fleet.snapshot
        if snapshot is not self._snapshot_seen:
            self._snapshot_seen = snapshot
            self._admitted_since = dict.fromkeys(TIERS, 0)

    def _ahead(self, tier: str) -> tuple[int, int]:
        """(work queued at this tier and above, work queued at this tier)."""
        self._sync()
        snapshot = self.fleet.snapshot
        depth = snapshot.queue_depth if snapshot is not None else {}
        total = 0
        own = 0
        for t in TIERS:
            n = depth.get(t, 0) + self._admitted_since[t]
            total += n
            if t == tier:
                own = n
                break
        return total, own

    def estimate_wait_ms(self, policy: Policy, tier: str) -> float:
        capacity = self.capacity_rps(policy)
        if capacity <= 0:
            return float("inf")
        total, own = self._ahead(tier)
        wait = total / capacity
        max_batch = policy.document.batching.max_batch_size
        slots = policy.reserved_slots(tier)
        above = total - own
        if slots and above >= max_batch:
            # The tiers above fill a batch: count on this tier's reserved slots
            # only. That rate is guaranteed, so the estimate errs on the safe side.
            wait = own / (capacity * slots / max_batch)
        elif not slots and above >= max(max_batch, capacity * self.fleet.batch_ms() / 1000.0):
            # No reserved slots and more queued above than the fleet can start
            # in one batch time: this tier waits until they drain.
            wait = float("inf")
        return wait * 1000.0

    def admitted(self, tier: str) -> None:
        """Count a request let in since the last view: at the decision, before
        its round trip to Redis, so that every request of a burst decided in
        one go counts the ones decided before it."""
        self._sync()
        self._admitted_since[tier] += 1

    def released(self, tier: str) -> None:
        """A request counted by ``admitted`` was not queued after all (its
        quota refused it, or Redis failed)."""
        self._sync()
        self._admitted_since[tier] = max(0, self._admitted_since[tier] - 1)

    def decide(self, policy: Policy, tier: str) -> Decision:
        """Would a request of ``tier`` fit its budget now? (Counts nothing.)"""
        wait_ms = self.estimate_wait_ms(policy, tier)
        budget_ms = policy.tiers[tier].latency_budget_ms
        if wait_ms <= budget_ms:
            return Decision(True, wait_ms)
        batch_ms = self.fleet.batch_ms() or 100.0
        retry_ms = batch_ms if wait_ms == float("inf") else max(batch_ms, wait_ms - budget_ms)
        return Decision(False, wait_ms, int(retry_ms))
