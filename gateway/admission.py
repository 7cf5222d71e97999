"""Capacity-adaptive admission: say no at the door when the work queued
ahead of a request cannot be served within its tier's latency budget.

Fleet capacity is measured, not configured: each worker reports in its
heartbeat the batch time it measures, so capacity is
``sum(max_batch / batch_time)`` over healthy workers, planned at the
policy's target utilization. The work ahead of a request is the queue depth
of its own and higher tiers (the fleet view, refreshed in the background)
plus what this gateway has admitted since that view was taken, divided by
capacity. That holds while the tiers above leave room; once they queue more
than a batch, a lower tier moves only through the slots its minimum batch
share reserves in every batch, so its wait is its own queue divided by that
share of capacity (with no share, it waits behind them). When workers die,
capacity drops within a heartbeat TTL and admission tightens by itself.
"""

from dataclasses import dataclass

from dispatcher.fleet import FleetView
from dispatcher.keys import TIERS
from dispatcher.service import BatchRule
from policies import Policy


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
        snapshot = self.fleet.snapshot
        if snapshot is None:
            return 0.0
        max_batch = policy.document.batching.max_batch_size
        raw = sum(max_batch * 1000.0 / w.batch_ms for w in snapshot.workers if w.batch_ms > 0)
        return raw * policy.document.capacity.target_utilization

    def _queued_above(self, tier: str) -> int:
        """What the last view saw queued at the tiers above (arrivals since then
        are not evidence that those tiers keep the workers full)."""
        snapshot = self.fleet.snapshot
        if snapshot is None:
            return 0
        return sum(snapshot.queue_depth.get(t, 0) for t in TIERS[: TIERS.index(tier)])

    def _ahead(self, tier: str) -> tuple[int, int]:
        """(work queued at this tier and above, work queued at this tier)."""
        snapshot = self.fleet.snapshot
        if snapshot is not self._snapshot_seen:
            self._snapshot_seen = snapshot
            self._admitted_since = dict.fromkeys(TIERS, 0)
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
        if self._queued_above(tier) >= max_batch:
            # The tiers above fill whole batches: this tier gets its reserved slots only.
            slots = BatchRule.from_policy(policy).min_slots()[TIERS.index(tier)]
            wait = own / (capacity * slots / max_batch) if slots else float("inf")
        return wait * 1000.0

    def decide(self, policy: Policy, tier: str) -> Decision:
        wait_ms = self.estimate_wait_ms(policy, tier)
        budget_ms = policy.tiers[tier].latency_budget_ms
        if wait_ms <= budget_ms:
            self._admitted_since[tier] += 1
            return Decision(True, wait_ms)
        batch_ms = self.fleet.batch_ms() or 100.0
        retry_ms = batch_ms if wait_ms == float("inf") else max(batch_ms, wait_ms - budget_ms)
        return Decision(False, wait_ms, int(retry_ms))
