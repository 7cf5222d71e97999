"""One backend serving several Redis shards (``base/queue/shards.py``).

A worker serves every shard of its deployment: one batch loop per shard,
each forming its batches from its own shard's queues, and one backend that
still runs one call at a time. The gate decides whose call runs next when
the backend frees: the call whose batch holds the highest tier, then the
one waiting longest (so shards with the same tiers waiting take turns).
A batch costs the backend its time however few it holds, so strict
priority between shards would starve a shard of lower tiers while a
shard of higher ones runs small batches that one shard's batches would
have filled with the lower tiers. So a call passed over for a higher
tier goes next when the call that passed it was not nearly full
(``full_at``): as in one shard, a lower tier runs in what the higher ones
leave free, and waits while they fill whole batches.

Batches are formed late here too: a member whose call just ended takes
its next batch at once only while no other member waits (``contended``);
otherwise it answers what it ran, then waits for a turn (``reserve``) with
the rank of its last batch as its guess of what it will take, and takes
when the turn is its own, so no batch waits at the gate while another
runs (one formed by a dispatcher for an idle member may, once). The gate
keeps the backend for up to ``hold_s`` after a call for the member that
ran it, so its next turn is chosen with everyone's. A lower tier's batch
runs ahead of a higher tier's request on another shard only when the
guess was one batch out of date: one batch's worth at most.
"""

import heapq
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from infergate.base.tiers import TIERS
from infergate.gpu.backend import Backend

HOLD_S = 0.010
# A turn reserved and not used by a call within this long lapses (the
# member found nothing to run, or failed before its call).
RESERVED_S = 1.0
PASSED = -1  # (the rank of a call passed over once)


class Gate:
    def __init__(
        self, full_at: int = 90, hold_s: float = HOLD_S, reserved_s: float = RESERVED_S
    ) -> None:
        self.full_at = full_at
        self.hold_s = hold_s
        self.reserved_s = reserved_s
        self._cond = threading.Condition()
        self._owner: int | None = None  # the shard whose turn it is
        self._calling = False  # (its call runs; else it is reserved)
        self._reserved_until = 0.0
        self._waiting: list[tuple[int, int, int]] = []  # (rank, ticket, shard): a heap
        self._tickets = itertools.count()
        self._held_for: int | None = None  # the shard whose call just ended
        self._held_until = 0.0
        self._passing: int | None = None  # the rank of a call running not nearly full

    def contended(self, shard: int) -> bool:
        """Another shard's member waits for a turn, or has it."""
        with self._cond:
            return any(s != shard for _, _, s in self._waiting) or self._owner not in (
                None,
                shard,
            )

    def reserve(self, shard: int, rank: int) -> None:
        """Wait for ``shard``'s turn, for a batch it has not taken yet whose
        best tier is likely ``rank``; its next call runs in it (``turn``)."""
        with self._cond:
            self._acquire(shard, rank, calling=False)

    def cancel(self, shard: int) -> None:
        """``shard`` reserved a turn and has nothing to run in it."""
        with self._cond:
            if self._owner == shard and not self._calling:
                self._owner = None
                self._cond.notify_all()

    @contextmanager
    def turn(self, shard: int, rank: int, size: int = 0) -> Iterator[None]:
        """Hold the backend for one call of ``shard`` of ``size`` inputs
        whose best tier is ``rank``."""
        with self._cond:
            if self._owner != shard or self._calling or self._lapsed():
                self._acquire(shard, rank, calling=True)
            self._calling = True
            if size < self.full_at:  # (those it passes over go next)
                self._passing = rank
                self._waiting = [(PASSED if r > rank else r, t, s) for r, t, s in self._waiting]
                heapq.heapify(self._waiting)
        try:
            yield
        finally:
            with self._cond:
                self._owner, self._calling, self._passing = None, False, None
                self._held_for, self._held_until = shard, time.monotonic() + self.hold_s
                self._cond.notify_all()

    def _acquire(self, shard: int, rank: int, calling: bool) -> None:
        ticket = next(self._tickets)
        if self._passing is not None and rank > self._passing:
            rank = PASSED  # (passed over by the call running now)
        heapq.heappush(self._waiting, (rank, ticket, shard))
        if self._held_for == shard:
            self._held_for = None  # (it came back: the choice may be made)
        self._cond.notify_all()
        while not self._may_run(ticket):
            self._cond.wait(self._wait_s())
        heapq.heappop(self._waiting)
        self._owner, self._calling = shard, calling
        self._reserved_until = time.monotonic() + self.reserved_s
        self._cond.notify_all()  # (the others wait on what this turn is now)

    def _lapsed(self) -> bool:
        return (
            self._owner is not None
            and not self._calling
            and (time.monotonic() >= self._reserved_until)
        )

    def _may_run(self, ticket: int) -> bool:
        if self._waiting[0][1] != ticket:
            return False
        if self._owner is not None and not self._lapsed():
            return False
        return self._held_for is None or time.monotonic() >= self._held_until

    def _wait_s(self) -> float | None:
        now = time.monotonic()
        ends = [self._held_until] if self._held_for is not None else []
        if self._owner is not None and not self._calling:
            ends.append(self._reserved_until)
        return max(0.0, min(ends) - now) if ends else None


class GatedBackend:
    """One shard's face of a backend shared through a gate."""

    def __init__(self, backend: Backend, gate: Gate, shard: int) -> None:
        self.backend = backend
        self.name = backend.name
        self.fingerprint = backend.fingerprint
        self.gate = gate
        self.shard = shard
        self.last_rank = len(TIERS)  # (the best tier of its last call: the next one's guess)

    def infer(self, inputs: list[str]) -> list[str]:
        with self._turn(inputs):
            return self.backend.infer(list(inputs))

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        with self._turn(inputs):
            return self.backend.infer_sampled(list(inputs), temperatures)

    @contextmanager
    def _turn(self, inputs: list[str]) -> Iterator[None]:
        rank = getattr(inputs, "rank", len(TIERS))
        with self.gate.turn(self.shard, rank, len(inputs)):
            self.last_rank = rank
            yield

    def contended(self) -> bool:
        return self.gate.contended(self.shard)

    def reserve(self) -> None:
        self.gate.reserve(self.shard, self.last_rank)

    def cancel(self) -> None:
        self.gate.cancel(self.shard)

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        return self.backend.clip(text, max_tokens)
