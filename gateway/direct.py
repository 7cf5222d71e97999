"""Direct mode: while a gateway cannot reach its shard's Redis, it serves the
tiers the policy names (``direct.tiers``) itself, when their model's backend
is a server it can call (``http:``, ``kserve-v2:``, ``openai:``), rather
than answer 503: availability at the cost of batching across gateways.

A batcher of its own per model (one call in flight per worker slot of the
policy, the highest tier first, each request's deadline kept), at most
``direct.max_requests`` held at once; quotas counted by this gateway alone
(not exact across gateways while it lasts); nothing written to Redis, so
nothing is left there and nothing is answered twice when Redis returns and
the gateway goes back to the queue by itself. An in-process backend cannot
be reached from a gateway: its requests fail fast, as before.
"""

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from infergate.base import clock, logs, wire
from infergate.base.loops import Background
from infergate.base.tiers import TIERS
from infergate.gateway.errors import ApiError
from infergate.gateway.quota import Charge
from infergate.policies import KeyEntry, Policy
from infergate.policies.schema import Model

log = logs.get(__name__)

RETRY_DIRECT_MS = 500
WATCH_S = 0.5


class DirectCall(Protocol):
    """A model's server, called with a whole batch (blocking, from a thread):
    each input's output and its tokens, or an exception for the batch."""

    def __call__(
        self, inputs: list[str], max_tokens: list[int], deadline_ms: int
    ) -> list[tuple[str, int]]: ...


# The server a model's backend names, or None where it runs in a worker's process.
MakeCall = Callable[[str, Model], DirectCall | None]


@dataclass
class _Waiting:
    text: str
    max_tokens: int
    deadline_ms: int
    enqueued_ms: int
    answer: "asyncio.Future[wire.Result]" = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Batcher:
    """One model's direct batcher: ``slots`` calls at most in flight, each of
    up to ``max_batch`` requests in tier order, oldest first in a tier."""

    def __init__(self, call: DirectCall, spec: tuple[str, str], worker_id: str) -> None:
        self.call = call
        self.spec = spec  # (the backend and options it was made for)
        self.worker_id = worker_id
        self._waiting: list[deque[_Waiting]] = [deque() for _ in TIERS]
        self._in_flight = 0
        self._held = 0  # requests waiting for their answer here
        self._calls = Background("direct.run_failed")

    def held(self) -> int:
        return self._held

    async def infer(
        self, text: str, tier: str, max_tokens: int, deadline_ms: int, slots: int, max_batch: int
    ) -> wire.Result:
        waiting = _Waiting(text, max_tokens, deadline_ms, clock.now_ms())
        queue = self._waiting[TIERS.index(tier)]
        queue.append(waiting)
        self._held += 1
        self._start_calls(slots, max_batch)
        remaining_s = max(0.0, (deadline_ms - clock.now_ms()) / 1000.0)
        try:
            return await asyncio.wait_for(asyncio.shield(waiting.answer), remaining_s)
        except TimeoutError:
            raise ApiError("TIMEOUT", "no result within the request's deadline") from None
        finally:
            self._held -= 1
            if not waiting.answer.done():  # (its client left, or its deadline passed)
                waiting.answer.cancel()
                if waiting in queue:  # (not taken yet: it goes now, not when a slot frees)
                    queue.remove(waiting)

    def _start_calls(self, slots: int, max_batch: int) -> None:
        while self._in_flight < slots and any(self._waiting):
            batch = self._take(max_batch)
            if not batch:
                return
            self._in_flight += 1
            self._calls.run(self._run(batch, slots, max_batch))

    def _take(self, max_batch: int) -> list[_Waiting]:
        """Up to ``max_batch`` live requests, the highest tier first."""
        now_ms = clock.now_ms()
        batch: list[_Waiting] = []
        for queue in self._waiting:
            while queue and len(batch) < max_batch:
                waiting = queue.popleft()
                if not waiting.answer.done() and waiting.deadline_ms > now_ms:
                    batch.append(waiting)
        return batch

    async def _run(self, batch: list[_Waiting], slots: int, max_batch: int) -> None:
        started_ms = clock.now_ms()
        try:
            outputs = await asyncio.to_thread(
                self.call,
                [w.text for w in batch],
                [w.max_tokens for w in batch],
                max(w.deadline_ms for w in batch),
            )
            if len(outputs) != len(batch):
                raise ValueError(f"{len(outputs)} outputs for {len(batch)} inputs")
        except Exception as exc:  # (the server's failure: each request's 503)
            logs.limited(log, "direct.call_failed", level="warning", error=str(exc)[:200])
            for waiting in batch:
                _settle(waiting, exc=_server_failed())
        else:
            infer_ms = clock.now_ms() - started_ms
            for waiting, (output, tokens) in zip(batch, outputs, strict=True):
                result = wire.Result(
                    "",
                    "direct",
                    len(batch),
                    self.worker_id,
                    started_ms - waiting.enqueued_ms,
                    infer_ms,
                    output=output,
                    served_by="direct",
                    tokens=tokens,
                )
                _settle(waiting, result)
        finally:
            self._in_flight -= 1
            self._start_calls(slots, max_batch)


def _settle(
    waiting: _Waiting, result: wire.Result | None = None, exc: BaseException | None = None
) -> None:
    if waiting.answer.done():
        return
    if exc is not None:
        waiting.answer.set_exception(exc)
    else:
        waiting.answer.set_result(result)  # type: ignore[arg-type]


def _server_failed() -> ApiError:
    return ApiError(
        "SERVICE_OVERLOADED",
        "Redis is unreachable and the model's server failed this call in direct mode; retry",
        RETRY_DIRECT_MS,
    )


class LocalQuota:
    """A key's limits counted by this gateway alone while it serves in
    direct mode: for each of its windows, ten buckets of a tenth of it in
    this process's memory (a charge adds to one number, whatever its cost);
    a request fits while the last ten buckets and it stay within the limit."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], dict[int, int]] = {}

    def charge(self, key: KeyEntry, charges: list[Charge]) -> tuple[Charge, int] | None:
        """Charge every limit, or none: the first without room and the ms
        until it has, if one is."""
        now_ms = clock.now_ms()
        windows = []
        for c in charges:
            window_ms = c.counter.window_s * 1000
            current = now_ms * 10 // window_ms
            buckets = self._buckets.setdefault((key.id, c.counter.key), {})
            for old in [b for b in buckets if b <= current - 10]:
                del buckets[old]
            cost = c.counter.cost
            if cost > 0 and sum(buckets.values()) + cost > c.counter.amount:
                oldest = min(buckets, default=current)
                return c, max(1, (oldest + 10) * window_ms // 10 - now_ms)
            windows.append((buckets, current, cost))
        for buckets, current, cost in windows:
            buckets[current] = buckets.get(current, 0) + cost
        return None


class DirectMode:
    """A gateway's direct mode: whether a request is served in it, its
    batchers (one per model whose server this gateway can call), its local
    quota, and the shards it is on for (logged and counted as it starts
    and ends)."""

    def __init__(self, make_call: MakeCall, gateway_id: str) -> None:
        self._make_call = make_call
        self._worker_id = f"direct:{gateway_id}"
        self._batchers: dict[str, tuple[tuple[str, str], Batcher | None]] = {}
        self._quota: LocalQuota | None = None
        self.on_shards: set[int] = set()

    @property
    def quota(self) -> LocalQuota:
        """Made on first use (its storage starts a thread of its own)."""
        if self._quota is None:
            self._quota = LocalQuota()
        return self._quota

    def batcher(self, name: str, model: Model) -> Batcher | None:
        """The model's batcher, made again for a new backend or options."""
        spec = (model.backend, repr(sorted(model.options.items())))
        known = self._batchers.get(name)
        if known is not None and known[0] == spec:
            return known[1]
        call = self._make_call(name, model)
        batcher = None if call is None else Batcher(call, spec, self._worker_id)
        self._batchers[name] = (spec, batcher)
        return batcher

    def serves(self, policy: Policy, tier: str, name: str) -> Batcher | None:
        """The batcher that serves a request of ``tier`` to model ``name``
        in direct mode, if the policy lets the tier and the model's server
        can be called."""
        if tier not in policy.document.direct.tiers:
            return None
        return self.batcher(name, policy.models[name])

    def held(self) -> int:
        return sum(b.held() for _, b in self._batchers.values() if b is not None)

    def started(self, shard: int) -> bool:
        """Note that ``shard`` is served in direct mode; True the first time."""
        if shard in self.on_shards:
            return False
        self.on_shards.add(shard)
        log.warning(
            "direct_mode.started",
            shard=shard,
            note="Redis is unreachable: the policy's direct.tiers are served by this gateway",
        )
        return True

    def ended(self, shard: int) -> None:
        self.on_shards.discard(shard)
        log.warning("direct_mode.ended", shard=shard, note="Redis answers again: queued as before")
