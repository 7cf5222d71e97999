"""A call of several prompts (``/v1/completions`` with a list) as one unit.

Every prompt is checked before any is admitted. The key's quotas are
charged for the whole list in one step, or not at all: a list over a limit
as a whole can never be admitted and is refused at once, uncharged, and
not worth a retry. Its GPU estimate is never cut to what is left of a
budget, as a lone request's may be: the list would run every prompt on it.
Each prompt then queues without being charged again.
If the call fails or its client leaves, every prompt is withdrawn by id
(those whose admit was still on its way too: take drops them), and what was
charged for the prompts that never queued is given back.
"""

from dataclasses import dataclass, field

from infergate.base import logs
from infergate.base.errors import STORE_ERRORS
from infergate.gateway import reservations
from infergate.gateway.charging import (
    budget_spent,
    gpu_reservation,
    quota_refused,
    store_refused,
)
from infergate.gateway.models import ModelLane
from infergate.gateway.quota import Reservation
from infergate.gateway.service import Gateway
from infergate.policies import KeyEntry, Tier

log = logs.get(__name__)

# A list's GPU estimate must fit its budget whole (``Quota.charges``); a
# prompt unlike the key's measured requests is estimated at all of it.
_AS_ESTIMATED = (
    "as estimated (a prompt unlike the key's measured requests is estimated at all of it;"
    " sent alone, it runs on what is left)"
)


@dataclass
class ListCharge:
    """The quota charged for a list, and the prompts that have used it."""

    headers: dict[str, str]
    # Each prompt's input characters, by request id, until it queues (or is
    # served without queueing): what a failed list gives back.
    unused: dict[str, int] = field(default_factory=dict)
    # What the list reserved, and each prompt's part of it (tokens, GPU µs):
    # each prompt settles its own part as it is answered.
    reservation: Reservation | None = None
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The prompts whose enqueue is on its way (a prompt the list's failure
    # cancels meanwhile waits for its answer: ``inference._answered``). One
    # that queued leaves its part for the take that drops it unrun
    # (``waiting.cancel``), or settles it by its reply; never both. One
    # whose enqueue failed with Redis (it may have queued) keeps its part:
    # never over.
    sending: set[str] = field(default_factory=set)

    def use(self, request_id: str) -> None:
        self.unused.pop(request_id, None)
        self.sending.discard(request_id)

    def reservation_of(self, *request_ids: str) -> Reservation | None:
        """The part of the list's reservation that is these prompts'."""
        whole = self.reservation
        parts = [self.parts[rid] for rid in request_ids if rid in self.parts]
        if whole is None or not parts:
            return None
        tokens, gpu_us = sum(part[0] for part in parts), sum(part[1] for part in parts)
        return Reservation(
            tuple(c._replace(cost=tokens) for c in whole.by_tokens),
            tuple(c._replace(cost=gpu_us) for c in whole.by_gpu),
            whole.charged_ms,
        )


async def charge(
    gw: Gateway,
    lane: ModelLane,
    key: KeyEntry,
    tier: Tier,
    inputs: dict[str, str],
    max_tokens: int = 0,
) -> ListCharge:
    """Charge the key's quotas for every prompt (``inputs`` by request id)
    at once; 429 if they have no room for all of them, charging nothing.
    Each prompt's part of their reservation (``reservations.py``) is settled
    as it is answered."""
    chars = [len(text) for text in inputs.values()]
    parts = {}
    gpu = lane.quota.reserves_gpu(key, tier)
    if lane.quota.reserves_tokens(key, tier) or gpu:
        model = gw.policy.current.models[lane.name]
        out = reservations.output_bound(max_tokens, model)
        for request_id, text in inputs.items():
            bound = reservations.input_bound(text)
            gpu_us = gpu_reservation(lane, key, bound, out) if gpu else 0
            parts[request_id] = (bound + out, gpu_us)
    tokens = sum(part[0] for part in parts.values())
    gpu_us = sum(part[1] for part in parts.values())
    over = lane.quota.over_as_a_whole(key, tier, chars, tokens, gpu_us)
    if over is not None:
        raise quota_refused(
            gw,
            key,
            lane,
            f"this list of {len(chars)} prompts is over the key's {over.named} "
            f"{_AS_ESTIMATED if over.kind == 'gpu_budget' else 'as a whole'}: "
            "it cannot be admitted at once; send fewer prompts a call",
            retryable=False,
        )
    try:
        result = await lane.quota.charge_list(key, tier, chars, tokens, gpu_us)
    except STORE_ERRORS as exc:
        raise store_refused(gw, key, lane, exc) from exc
    headers = result.headers()
    if result.budget_use is not None:
        gw.budgets.seen(key.id, *result.budget_use)
    if result.over_budget:
        raise budget_spent(gw, key, lane, str(result.refused_by), result.retry_after_ms, headers)
    if not result.allowed:
        raise quota_refused(
            gw,
            key,
            lane,
            f"rate limit {result.refused_by} has no room for these {len(chars)} prompts",
            result.retry_after_ms,
            headers,
        )
    unused = {request_id: len(text) for request_id, text in inputs.items()}
    return ListCharge(headers, unused, result.reservation, parts)


async def withdraw(
    lane: ModelLane, key: KeyEntry, tier: Tier, ids: list[str], deadline_ms: int, spent: ListCharge
) -> None:
    """The list failed: every prompt withdrawn (take drops it), and the
    charge of those that never queued given back, their parts of the
    list's reservation with it (but of those still on their way: their
    own cancel leaves those)."""
    unused = list(spent.unused.values())
    unsent = [rid for rid in spent.unused if rid not in spent.sending]
    spent.unused.clear()
    try:
        await lane.queue.cancel_all(ids, deadline_ms)
        if unused:
            await lane.quota.refund(key, tier, sum(unused), len(unused))
        await lane.quota.settle(spent.reservation_of(*unsent), 0, 0)
    except STORE_ERRORS as exc:  # (Redis away: the prompts' deadlines end them; the charge stays)
        logs.limited(log, "request.withdraw_failed", level="warning", error=type(exc).__name__)
