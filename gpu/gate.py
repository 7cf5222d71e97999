"""One backend serving several Redis shards (``base/queue/shards.py``).

A worker serves every shard of its deployment: one batch loop per shard,
each forming its batches from its own shard's queues, and one backend that
still runs one call at a time. The gate decides whose call runs next when
the backend frees: the call whose batch holds the highest tier, then the
one waiting longest (so shards with the same tiers waiting take turns).

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


class Gate:
    def __init__(self, hold_s: float = HOLD_S, reserved_s: float = RESERVED_S) -> None:
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
    def turn(self, shard: int, rank: int) -> Iterator[None]:
        """Hold the backend for one call of ``shard`` whose best tier is ``rank``."""
        with self._cond:
            if self._owner != shard or self._calling or self._lapsed():
                self._acquire(shard, rank, calling=True)
            self._calling = True
        try:
            yield
        finally:
            with self._cond:
                self._owner, self._calling = None, False
                self._held_for, self._held_until = shard, time.monotonic() + self.hold_s
                self._cond.notify_all()

    def _acquire(self, shard: int, rank: int, calling: bool) -> None:
        me = (rank, next(self._tickets), shard)
        heapq.heappush(self._waiting, me)
        if self._held_for == shard:
            self._held_for = None  # (it came back: the choice may be made)
        self._cond.notify_all()
        while not self._may_run(me):
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

    def _may_run(self, me: tuple[int, int, int]) -> bool:
        if self._waiting[0] != me:
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
        with self.gate.turn(self.shard, rank):
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
