"""A call of several prompts (``/v1/completions`` with a list) as one unit.

Every prompt is checked before any is admitted. The key's quotas are
charged for the whole list in one step, or not at all: a list over a limit
as a whole can never be admitted and is refused at once, uncharged, and
not worth a retry. Each prompt then queues without being charged again.
If the call fails or its client leaves, every prompt is withdrawn by id
(those whose admit was still on its way too: take drops them), and what was
charged for the prompts that never queued is given back.
"""

from dataclasses import dataclass, field

from infergate.base import logs
from infergate.base.errors import STORE_ERRORS
from infergate.gateway import reservations
from infergate.gateway.charging import budget_spent, quota_refused, store_refused
from infergate.gateway.models import ModelLane
from infergate.gateway.service import Gateway
from infergate.policies import KeyEntry, Tier

log = logs.get(__name__)


@dataclass
class ListCharge:
    """The quota charged for a list, and the prompts that have used it."""

    headers: dict[str, str]
    # Each prompt's input characters, by request id, until it queues (or is
    # served without queueing): what a failed list gives back.
    unused: dict[str, int] = field(default_factory=dict)

    def use(self, request_id: str) -> None:
        self.unused.pop(request_id, None)


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
    Their reservation is kept whole (``reservations.py``)."""
    chars = [len(text) for text in inputs.values()]
    tokens = gpu_us = 0
    if lane.quota.reserves_tokens(key, tier):
        model = gw.policy.current.models[lane.name]
        out = reservations.output_bound(max_tokens, model)
        tokens = sum(reservations.input_bound(text) + out for text in inputs.values())
    if lane.quota.reserves_gpu(key, tier):
        gpu_us = reservations.gpu_bound(lane.fleet.slowest_batch_ms) * len(chars)
    over = lane.quota.over_as_a_whole(key, tier, chars, tokens, gpu_us)
    if over is not None:
        raise quota_refused(
            gw,
            key,
            lane,
            f"this list of {len(chars)} prompts is over the key's limit of {over} as a whole: "
            "it can never be admitted at once; send fewer prompts a call",
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
    return ListCharge(headers, {request_id: len(text) for request_id, text in inputs.items()})


async def withdraw(
    lane: ModelLane, key: KeyEntry, tier: Tier, ids: list[str], deadline_ms: int, spent: ListCharge
) -> None:
    """The list failed: every prompt withdrawn (take drops it), and the
    charge of those that never queued given back."""
    unused = list(spent.unused.values())
    spent.unused.clear()
    try:
        await lane.queue.cancel_all(ids, deadline_ms)
        if unused:
            await lane.quota.refund(key, tier, sum(unused), len(unused))
    except STORE_ERRORS as exc:  # (Redis away: the prompts' deadlines end them; the charge stays)
        logs.limited(log, "request.withdraw_failed", level="warning", error=type(exc).__name__)
