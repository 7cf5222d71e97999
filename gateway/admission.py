"""Capacity-adaptive admission: say no at the door when a request cannot be
served within its tier's latency budget, and say it to the key that floods.

Capacity ``C`` is measured, not configured (``infergate.base.fleet``: the
serving workers' batch times), planned at the policy's target utilization.
A tier's requests are served at the rate the tiers above leave,
``C - (their arrival rate)`` (the gateways' heartbeats carry what each
admitted per tier), after the work already queued above them; or, whatever
is above, at the rate of the batch slots the tier reserves. So the requests
of a tier that can wait and still be answered within its budget (less its
own batch's time: a full batch's on a GPU, where a batch takes the same
whatever its size; by its size where a batch's time grows with it, a model
on a CPU or an engine that serves each input apart) is its *allowance*:

    max(budget * (C - arrivals above) - queued above,  budget * C * slots / batch)

The tiers' arrival rates are the larger of the fleet's (heartbeats: seconds
old) and this gateway's own in the last half second (over half a second) times
the gateways alive (at once): when overload starts, the tiers above are seen taking the
fleet within a fleet view, before a lower tier has queued more than its
budget can serve at its reserved rate.

A tier whose allowance is under one request is refused here, with no Redis
round trip. Inside a tier, requests are served in fair order (``take_*.lua``),
so a key waits behind its own queue over its weight's share of the tier,
not behind the whole tier: ``admit.lua`` admits a key's request while the key
holds less than that share of the allowance (and at least one), exactly and
across gateways. A burst the fleet clears within budget is admitted whole;
a key that floods is the one refused; when workers die, ``C`` drops within a
heartbeat TTL and every allowance with it.
"""

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infergate.base import clock
from infergate.base.fleet import FleetView
from infergate.base.tiers import TIERS
from infergate.policies import Policy


@dataclass(frozen=True)
class Decision:
    admitted: bool
    wait_ms: float
    retry_after_ms: int = 0
    # How many of the tier's requests may wait now (admit.lua's share check).
    allowance: float = 0.0


class Admission:
    def __init__(
        self,
        fleet: FleetView,
        admitted_here: Callable[[], Sequence[int]] = lambda: (0,) * len(TIERS),
    ) -> None:
        self.fleet = fleet
        self._snapshot_seen: object = None
        self._admitted_since: dict[str, int] = dict.fromkeys(TIERS, 0)
        # What this gateway let in per tier, running (tiers.TIERS order; the
        # counts its heartbeat carries), sampled at each new view (monotonic
        # s, counts) for its own arrival rates.
        self._admitted_here = admitted_here
        self._samples: deque[tuple[float, Sequence[int]]] = deque()
        self._local_rps = dict.fromkeys(TIERS, 0.0)

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
            self._sample(1 if snapshot is None else max(1, len(snapshot.gateways)))

    def _sample(self, gateways: int) -> None:
        """This gateway's arrival rates over the last half second, times the
        gateways alive (requests spread over them)."""
        now = clock.monotonic_s()
        counted = tuple(self._admitted_here())
        self._samples.append((now, counted))
        while now - self._samples[0][0] > 0.5:
            self._samples.popleft()
        first = self._samples[0][1]
        for i, t in enumerate(TIERS):
            # (over the whole half second, however short the span sampled: a
            # burst let in at once is a burst, queued above, not a rate)
            self._local_rps[t] = (counted[i] - first[i]) / 0.5 * gateways

    def _queued(self, tier: str) -> tuple[int, int]:
        """(requests queued in the tiers above ``tier``, in ``tier``): the
        fleet view's depths plus what this gateway admitted since it."""
        self._sync()
        snapshot = self.fleet.snapshot
        depth = snapshot.queue_depth if snapshot is not None else {}
        above = 0
        for t in TIERS:
            if t == tier:
                return above, depth.get(t, 0) + self._admitted_since[t]
            above += depth.get(t, 0) + self._admitted_since[t]
        return above, 0

    def _rates(self, policy: Policy, tier: str) -> tuple[float, float]:
        """(the rate the tiers above leave this tier, the rate of its reserved slots)."""
        self._sync()  # (this gateway's own rates are sampled at each new view)
        capacity = self.capacity_rps(policy)
        above = 0.0
        for t in TIERS:
            if t == tier:
                break
            above += max(self.fleet.arrival_rps(t), self._local_rps[t])
        reserved = capacity * policy.reserved_slots(tier) / policy.document.batching.max_batch_size
        return capacity - above, reserved

    def _own_batch_ms(self, policy: Policy, queued: int) -> float:
        """The time of the batch a request joins behind ``queued`` others: a
        full batch's on a GPU; on a CPU, or an engine that serves each input
        apart, a short queue's batch is far quicker than a full one's."""
        max_batch = policy.document.batching.max_batch_size
        return self.fleet.batch_of_ms(min(max_batch, queued + 1), max_batch)

    def _budget_s(self, policy: Policy, tier: str, queued: int = 0) -> float:
        """The tier's budget for waiting: its latency budget less its own batch's time."""
        own_ms = self._own_batch_ms(policy, queued)
        return (policy.tiers[tier].latency_budget_ms - own_ms) / 1000.0

    def allowance(self, policy: Policy, tier: str) -> float:
        """How many of ``tier``'s requests can wait now and be answered within its budget."""
        left, reserved = self._rates(policy, tier)
        above, own = self._queued(tier)
        budget_s = self._budget_s(policy, tier, above + own)
        by_priority = budget_s * left - above if left > 0 else 0.0
        # (with nothing queued at or above it, one goes at once, whatever
        # the budget: a budget under one batch time never closes a tier)
        idle = 1.0 if above + own == 0 and self.capacity_rps(policy) > 0 else 0.0
        return max(by_priority, budget_s * reserved, idle)

    def estimate_wait_ms(self, policy: Policy, tier: str) -> float:
        """The expected latency of one more request of ``tier`` behind all of
        the tier's queue (a key's own is shorter: its share, ``admit.lua``)."""
        left, reserved = self._rates(policy, tier)
        above, own = self._queued(tier)
        waits = []
        if left > 0:
            waits.append((above + own + 1) / left)
        if reserved > 0:
            waits.append((own + 1) / reserved)
        if not waits:
            return float("inf")
        return min(waits) * 1000.0 + self._own_batch_ms(policy, above + own)

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
        """May a request of ``tier`` wait now? (Counts nothing.)"""
        allowance = self.allowance(policy, tier)
        if allowance >= 1.0:
            return Decision(True, 0.0, 0, allowance)
        wait_ms = self.estimate_wait_ms(policy, tier)
        budget_ms = policy.tiers[tier].latency_budget_ms
        batch_ms = self.fleet.batch_ms() or 100.0
        retry_ms = batch_ms if wait_ms == float("inf") else max(batch_ms, wait_ms - budget_ms)
        return Decision(False, wait_ms, int(retry_ms), allowance)
