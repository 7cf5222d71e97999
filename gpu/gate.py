"""One backend serving several Redis shards (``base/queue/shards.py``).

A worker serves every shard of its deployment: one batch loop per shard,
each forming its batches from its own shard's queues the moment the
backend returns, as with one shard, and one backend that still runs one
call at a time. Each loop's call comes here, and the backend's calls are
filled from the inputs of every call waiting, in priority order (the
call whose batch holds the highest tier first, then the one waiting
longest), up to ``max_inputs``: two shards' batches of 45 run as one call
of 90, and when they hold more than one call, the rest of a batch runs
first in the next (its loop is answered when all of it has run). So a
lower tier fills the room the higher ones leave, and waits while they
fill whole calls, as on one shard, but a batch already formed, passed
over by three calls, runs next (its requests are out of the queue and its
worker's hang timer runs); a batch costs the backend its time
once, however the keys are spread.

The gate waits a moment (``hold_s``) for the loops whose calls just ended:
they form their next batches at once, and those are filled in too; a
loop that finds nothing to take says so (``pass_turn``) and is not
waited for. A backend call of several loops' inputs that fails is run
again part by part, so an input that fails its backend fails only its
own loop's call (which isolates it as with one shard).

An idle loop's credit is on its shard's ``ready`` list, and there it says
the worker is free while the backend runs another shard's batch: a
dispatcher would hand it a batch that waits here for the backend, formed
a call too early, and the requests that come after it would wait a batch
more. So as a call is about to start, each idle loop's credit joins it
(``attach``: the loop's ``join``): a batch of what waits on its shard,
which the gate waits for (up to ``hold_s``) and runs in the same call, at
no cost to the backend; or, with nothing waiting there, the credit is
withdrawn until the call ends, and then given back (``give_back``): a
batch formed then, from all that came meanwhile, which the gate waits for
as for the loops that ran, or the credit back on ``ready``. These steps
run in order on a thread of the gate's own.
"""

import concurrent.futures
import threading
import time
from collections.abc import Callable

from infergate.base import logs
from infergate.base.tiers import TIERS
from infergate.gpu.backend import (
    MAX_BATCH,
    Backend,
    BackendError,
    Partial,
    Prompts,
    UpstreamError,
    conversations_of,
    deadline_of,
    max_tokens_of,
)

HOLD_S = 0.030
# A batch already formed has its requests out of the queue and its worker's
# hang timer running: one passed over by this many calls runs next.
PASSES_MAX = 3
JUMPED = -1
# How long a call waits for the idle loops' joins (Redis round trips) before
# it starts without them; and how long a loop whose shard failed one is not
# asked again (a shard away must not hold every call back).
JOIN_WAIT_S = 0.1
FAILED_PAUSE_S = 2.0

log = logs.get(__name__)


class _Call:
    """One loop's call: its inputs, given to backend calls in order, and
    what came back for each."""

    def __init__(
        self,
        shard: int,
        rank: int,
        ticket: int,
        inputs: list[str],
        temperatures: list[float] | None,
    ) -> None:
        self.shard, self.rank, self.ticket = shard, rank, ticket
        self.inputs, self.temperatures = inputs, temperatures
        # Each input's max_tokens (0 for none), and the latest deadline (``Prompts``).
        self.max_tokens = max_tokens_of(inputs)
        self.deadline_ms = deadline_of(inputs)
        self.conversations = conversations_of(inputs)
        self.outputs: list[str] = [""] * len(inputs)
        self.passed = 0  # backend calls that ran without it while it waited
        self.given = 0  # inputs given to a backend call so far
        self.answered = 0  # inputs answered (or failed) so far
        self.error: BaseException | None = None

    def order(self) -> tuple[int, int]:
        return self.rank, self.ticket

    def done(self) -> bool:
        return self.answered == len(self.inputs)


class _Part:
    """Some of a call's inputs in one backend call."""

    def __init__(self, call: _Call, start: int, end: int) -> None:
        self.call, self.start, self.end = call, start, end

    def inputs(self) -> list[str]:
        return self.call.inputs[self.start : self.end]

    def temperatures(self) -> list[float]:
        given = self.call.temperatures
        return [0.0] * (self.end - self.start) if given is None else given[self.start : self.end]

    def max_tokens(self) -> list[int]:
        return self.call.max_tokens[self.start : self.end]

    def conversations(self) -> list[str | None]:
        return self.call.conversations[self.start : self.end]


# A loop's credit steps: joining a call with room for so many inputs (the
# size of the batch formed for it; whether the credit was withdrawn
# instead), and giving a withdrawn credit back (whether a batch was formed).
Join = Callable[[int], tuple[int, bool]]
GiveBack = Callable[[], bool]


class Gate:
    def __init__(self, backend: Backend, max_inputs: int = MAX_BATCH, hold_s: float = HOLD_S):
        self.backend = backend
        self.max_inputs = max(1, min(MAX_BATCH, max_inputs))
        self.hold_s = hold_s
        self._cond = threading.Condition()
        self._busy = False
        self._waiting: list[_Call] = []  # calls with inputs not given yet
        self._tickets = 0
        self._expected: set[int] = set()  # the shards whose calls just ended
        self._held_until = 0.0
        self.together = 0  # backend calls that ran more than one shard's inputs
        # Each idle loop's credit steps (attach), run in order on one thread.
        self._credits: dict[int, tuple[Join, GiveBack]] = {}
        self._credit_steps: concurrent.futures.ThreadPoolExecutor | None = None
        self._joined = False  # the next call's idle loops were asked to join it
        self._withdrawn: set[int] = set()  # their credits, withdrawn for it
        self._calls_ended = 0
        self._paused_until: dict[int, float] = {}  # (a loop whose shard failed a step)
        self._last_step: concurrent.futures.Future[object] | None = None

    def attach(self, shard: int, join: Join, give_back: GiveBack) -> None:
        """``shard``'s loop's credit steps: ``join(room)`` as a call of other
        shards starts, with room for so many inputs (the size of the batch
        formed for it, and whether the credit was withdrawn instead),
        ``give_back()`` as it ends (whether a batch was formed)."""
        with self._cond:
            self._credits[shard] = (join, give_back)
            if self._credit_steps is None:
                self._credit_steps = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="gate-credits"
                )

    def call(
        self, shard: int, rank: int, inputs: list[str], temperatures: list[float] | None
    ) -> list[str]:
        """Run ``inputs`` of ``shard`` (best tier ``rank``) in the backend
        calls to come, beside the other shards' inputs; blocks until done."""
        if not inputs:
            return []
        with self._cond:
            self._tickets += 1
            me = _Call(shard, rank, self._tickets, inputs, temperatures)
            self._waiting.append(me)
            self._expected.discard(shard)
            self._cond.notify_all()
            while not me.done():
                if not self._leads(me):
                    self._cond.wait(self._wait_s(me))
                    continue
                if self._joined_by_idle():
                    continue  # (their batches are waited for)
                parts = self._fill()
                self._busy = True
                self._cond.release()
                try:
                    self._run(parts)
                finally:
                    self._cond.acquire()
                    self._ended(parts)
        if me.error is not None:
            raise me.error
        return me.outputs

    def pass_turn(self, shard: int) -> None:
        """``shard``'s loop has nothing to run now: the gate does not wait for it."""
        with self._cond:
            if shard in self._expected:
                self._expected.discard(shard)
                self._cond.notify_all()

    def _leads(self, me: _Call) -> bool:
        """``me`` runs the next backend call: it is first, the backend is
        free, and the loops of the last call are back (or had their moment)."""
        if self._busy or not self._waiting or min(self._waiting, key=_Call.order) is not me:
            return False
        return not self._expected or time.monotonic() >= self._held_until

    def _wait_s(self, me: _Call) -> float | None:
        """Until the hold ends, for the call that leads then; the others are woken."""
        if self._busy or not self._expected or min(self._waiting, key=_Call.order) is not me:
            return None
        return max(0.0, self._held_until - time.monotonic())

    def _fill(self) -> list[_Part]:
        """The next backend call: the waiting calls' inputs, best tier first,
        up to ``max_inputs`` (a call may be split over two)."""
        parts, room = [], self.max_inputs
        for call in sorted(self._waiting, key=_Call.order):
            if room == 0:
                break
            take = min(room, len(call.inputs) - call.given)
            parts.append(_Part(call, call.given, call.given + take))
            call.given += take
            room -= take
        self._waiting = [c for c in self._waiting if c.given < len(c.inputs)]
        ran = {id(part.call) for part in parts}
        for call in self._waiting:
            if id(call) not in ran:
                call.passed += 1
                if call.passed >= PASSES_MAX:  # (it runs next, whatever its tier)
                    call.rank = JUMPED
        return parts

    def _ended(self, parts: list[_Part]) -> None:
        """The backend is free: the loops whose calls ended, and those whose
        credits come back now, get their moment to send their next call."""
        self._busy, self._joined = False, False
        self._calls_ended += 1
        withdrawn, self._withdrawn = self._withdrawn, set()
        ended = {part.call.shard for part in parts if part.call.done()}
        self._expected, self._held_until = ended | withdrawn, time.monotonic() + self.hold_s
        if withdrawn:
            self._submit(self._give_back, withdrawn)
        self._cond.notify_all()

    # -- the idle loops' credits (on the gate's own thread, in order) --------------

    def _joined_by_idle(self) -> bool:
        """Before a call starts (once): the idle loops join it; whether any
        formed a batch, which the call then waits for (up to ``hold_s``).
        Called holding the lock, and waits with it released."""
        if self._joined or self._credit_steps is None:
            return False
        self._joined = True
        if self._last_step is not None and not self._last_step.done():
            return False  # (a step still waits on a slow shard: none piles up behind it)
        idle = self._unpaused(set(self._credits) - {call.shard for call in self._waiting})
        if not idle:
            return False
        room = self.max_inputs - sum(len(call.inputs) - call.given for call in self._waiting)
        joining = self._submit(self._join, idle, room, self._calls_ended)
        if joining is None:
            return False
        self._busy = True  # (no other call starts meanwhile)
        self._cond.release()
        try:
            formed: set[int] = joining.result(JOIN_WAIT_S)  # type: ignore[assignment]
        except Exception:  # (late: what it does is handled as it ends, _join)
            formed = set()
        finally:
            self._cond.acquire()
            self._busy = False
            self._cond.notify_all()
        formed -= {call.shard for call in self._waiting}  # (already here)
        if not formed:
            return False
        self._expected |= formed
        self._held_until = time.monotonic() + self.hold_s
        return True

    def _join(self, shards: set[int], room: int, calls_ended: int) -> set[int]:
        """The loops that formed a batch for the call (within its room). The
        credits withdrawn for it come back as it ends; at once, if it ended
        before they were withdrawn (this ran late)."""
        formed, withdrawn = set(), set()
        with self._cond:
            shards = self._unpaused(shards)
        for shard in shards:
            try:
                size, marked = self._credits[shard][0](max(room, 0))
            except Exception as exc:  # (its shard is away: nothing was done)
                self._failed(shard, "gate.join_failed", exc)
                continue
            if size:
                formed.add(shard)
                room -= size
            if marked:
                withdrawn.add(shard)
        with self._cond:
            late = self._calls_ended != calls_ended
            if not late:
                self._withdrawn |= withdrawn
        if late and withdrawn:
            self._give_back(withdrawn)
        return formed

    def _give_back(self, shards: set[int]) -> None:
        """The credits withdrawn come back; the loops with no batch formed
        are not waited for."""
        for shard in shards:
            try:
                formed = self._credits[shard][1]()
            except Exception as exc:  # (the mark lapses: the loop offers its credit again)
                self._failed(shard, "gate.give_back_failed", exc)
                formed = False
            if not formed:
                self.pass_turn(shard)

    def _submit(
        self, step: Callable[..., object], *args: object
    ) -> "concurrent.futures.Future[object] | None":
        """``step`` on the gate's own thread, after those before it (None
        once the process exits). Called holding the lock."""
        if self._credit_steps is None:
            return None
        try:
            self._last_step = self._credit_steps.submit(step, *args)
        except RuntimeError:  # (the interpreter is shutting down)
            return None
        return self._last_step

    def _unpaused(self, shards: set[int]) -> set[int]:
        now = time.monotonic()
        return {shard for shard in shards if self._paused_until.get(shard, 0.0) <= now}

    def _failed(self, shard: int, event: str, exc: Exception) -> None:
        log.warning(event, shard=shard, error=type(exc).__name__)
        with self._cond:
            self._paused_until[shard] = time.monotonic() + FAILED_PAUSE_S

    def _run(self, parts: list[_Part]) -> None:
        """One backend call for every part, and part by part if that fails
        (so a part's error is its own call's), unless its server did not
        answer: waiting on it again for each part would only take longer."""
        if len({id(part.call) for part in parts}) > 1:
            try:
                outputs = self._backend_call(parts)
            except UpstreamError as exc:  # (no input at fault: each part's call, alike)
                for part in parts:
                    self._answer(part, None, exc)
                return
            except BaseException:
                pass  # (run again part by part, below)
            else:
                self.together += 1
                at = 0
                for part in parts:
                    size = part.end - part.start
                    self._answer(part, outputs[at : at + size], None)
                    at += size
                return
        for part in parts:
            try:
                self._answer(part, self._backend_call([part]), None)
            except BaseException as exc:
                self._answer(part, None, exc)

    @staticmethod
    def _answer(part: _Part, outputs: list[str] | None, error: BaseException | None) -> None:
        call = part.call
        whole = part.start == 0 and part.end == len(call.inputs)
        if isinstance(error, Partial) and not whole:
            # (a part's outcomes are not its call's: the call is split as any failed one)
            error = BackendError(str(error))
        if outputs is not None:
            call.outputs[part.start : part.end] = outputs
        if error is not None and call.error is None:
            call.error = error
        call.answered += part.end - part.start

    def _backend_call(self, parts: list[_Part]) -> list[str]:
        texts = [text for part in parts for text in part.inputs()]
        max_tokens = [n for part in parts for n in part.max_tokens()]
        conversations = [c for part in parts for c in part.conversations()]
        inputs = Prompts(
            texts,
            list(texts),
            None,
            min(part.call.rank for part in parts),
            max_tokens if any(max_tokens) else None,
            max(part.call.deadline_ms for part in parts),
            conversations if any(c is not None for c in conversations) else None,
        )
        if all(part.call.temperatures is None for part in parts):
            outputs = self.backend.infer(inputs)
        else:
            temperatures = [t for part in parts for t in part.temperatures()]
            outputs = self.backend.infer_sampled(inputs, temperatures)
        if len(outputs) != len(inputs):
            raise BackendError(f"the backend answered {len(outputs)} of {len(inputs)} inputs")
        return outputs


class GatedBackend:
    """A backend shared through a gate, as one shard's loop calls it."""

    def __init__(self, gate: Gate, shard: int) -> None:
        self.backend = gate.backend
        self.name = gate.backend.name
        self.fingerprint = gate.backend.fingerprint
        self.lacks = gate.backend.lacks
        self.upstream = gate.backend.upstream
        self.gate = gate
        self.shard = shard

    def infer(self, inputs: list[str]) -> list[str]:
        return self.gate.call(self.shard, _rank(inputs), inputs, None)

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        return self.gate.call(self.shard, _rank(inputs), inputs, list(temperatures))

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        return self.backend.clip(text, max_tokens)

    def pass_turn(self) -> None:
        self.gate.pass_turn(self.shard)


def _rank(inputs: list[str]) -> int:
    rank: int = getattr(inputs, "rank", len(TIERS))
    return rank
