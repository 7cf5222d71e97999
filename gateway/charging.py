"""Charging a request to its key's quotas, and queueing it in the same
step (``Quota.charge``), with what a client gets when a limit, a budget or
its key's share of its tier says no: 429 with the x-ratelimit-* headers,
429 BUDGET_EXCEEDED (no retry), 429 for a budget held in flight, or 503."""

from infergate.base import logs
from infergate.base.errors import STORE_ERRORS
from infergate.base.queue.inputs import Beside
from infergate.gateway import reservations
from infergate.gateway.errors import ApiError
from infergate.gateway.models import ModelLane
from infergate.gateway.quota import BUDGETS, QuotaResult, Reservation
from infergate.gateway.service import Gateway
from infergate.policies import KeyEntry, Tier

log = logs.get(__name__)

# The most a refusal for a budget held in flight tells its client to wait.
HELD_RETRY_MOST_MS = 1000


async def charge_quota(
    gw: Gateway,
    lane: ModelLane,
    key: KeyEntry,
    tier: Tier,
    input_chars: int,
    queue_on: str | None = None,
    envelope: bytes = b"",
    beside: Beside | None = None,
    allowance: float = 0.0,
    tokens: int = 0,
    gpu_us: int = 0,
) -> QuotaResult:
    """Charge the key's limits, ``tokens`` and ``gpu_us`` reserved of its
    token limits and budgets (and
    queue ``envelope`` on ``queue_on``, with its long input ``beside`` it, in
    the same step, if the key holds less than its share of the tier's
    ``allowance``); returns what was charged (its x-ratelimit-* headers, its
    reservation), or raises 429 (a limit) or 503 (the key's share)."""
    try:
        quota = await lane.quota.charge(
            key,
            tier,
            input_chars,
            queue_on,
            envelope,
            beside,
            allowance,
            gw.shares.recent_weight(key.tier, model=lane.label) if allowance else 0.0,
            tokens,
            gpu_us,
        )
    except STORE_ERRORS as exc:
        raise store_refused(gw, key, lane, exc) from exc
    headers = quota.headers()
    if quota.budget_use is not None:
        gw.budgets.seen(key.id, *quota.budget_use)
    if quota.over_share:
        # (not demand the fleet should grow for: one key over its share)
        gw.count_refused(key, "key_share", lane, for_capacity=False)
        raise over_share(key, lane)
    if quota.budget_held:
        raise budget_held(gw, key, lane, str(quota.refused_by), headers)
    if quota.over_budget:
        raise budget_spent(gw, key, lane, str(quota.refused_by), quota.retry_after_ms, headers)
    if not quota.allowed:
        raise quota_refused(
            gw,
            key,
            lane,
            f"rate limit {quota.refused_by} exceeded for this key",
            quota.retry_after_ms,
            headers,
        )
    return quota


def check_reservation(
    gw: Gateway,
    lane: ModelLane,
    key: KeyEntry,
    tier: Tier,
    input_chars: int,
    tokens: int,
    gpu_us: int = 0,
) -> None:
    """429, not worth a retry, for a request whose reservation of ``tokens``
    (or ``gpu_us``) is over a token limit or budget even when it is empty."""
    over = lane.quota.over_as_a_whole(key, tier, [input_chars], tokens, gpu_us)
    if over is None:
        return
    if over.kind == "cost":  # (its characters: its tokens play no part)
        message = (
            f"this request's input of {input_chars} characters is over the key's "
            f"{over.named} as a whole: it can never be admitted; send a shorter input"
        )
    else:
        reserves = f"{tokens} tokens (its input's bound and its max_tokens)"
        if gpu_us:
            reserves += f" and {gpu_us / 1e6:g} GPU seconds (for those tokens)"
        message = (
            f"this request reserves {reserves}, over the key's {over.named} as a whole: "
            "it can never be admitted; ask for fewer max_tokens, or send a shorter input"
        )
    if over.kind in BUDGETS:
        gw.count_refused(key, "budget", lane, for_capacity=False)
        raise ApiError("BUDGET_EXCEEDED", message, retryable=False)
    raise quota_refused(gw, key, lane, message, retryable=False)


def gpu_reservation(lane: ModelLane, key: KeyEntry, input_tokens: int, output_tokens: int) -> int:
    """What a request of ``key`` of at most ``input_tokens`` and
    ``output_tokens`` reserves of a GPU budget (``reservations.gpu_bound``),
    from its model's measurements of the calls the key's requests were in
    (``CostModel.call_line``)."""
    line = lane.quota.costs.call_line(key.id)
    return reservations.gpu_bound(input_tokens, output_tokens, line)


def gpu_job_reservation(
    lane: ModelLane, key: KeyEntry, input_tokens: int, output_tokens: int
) -> int:
    """What a job of ``key`` reserves of a GPU budget (``reservations.gpu_job_bound``)."""
    return reservations.gpu_job_bound(
        input_tokens, output_tokens, lane.quota.costs.call_line(key.id)
    )


async def settle(
    lane: ModelLane, reservation: Reservation | None, tokens: int, gpu_us: int
) -> None:
    """Give back what a request's reservation did not use, once it used
    ``tokens`` and ``gpu_us`` (Redis away: kept, so no limit or budget is
    ever overshot)."""
    if reservation is None:
        return
    try:
        await lane.quota.settle(reservation, tokens, gpu_us)
    except Exception as exc:  # (whatever failed, what was reserved stays: never over)
        logs.limited(log, "request.settle_failed", level="warning", error=type(exc).__name__)


def store_refused(gw: Gateway, key: KeyEntry, lane: ModelLane, exc: BaseException) -> ApiError:
    """Redis failed (or is full) while charging: counted, and the 503."""
    error = gw.store_failed(exc, lane.shard)
    reason = "redis_full" if lane.store.full else "redis"
    gw.count_refused(key, reason, lane, for_capacity=False)
    return error


def quota_refused(
    gw: Gateway,
    key: KeyEntry,
    lane: ModelLane,
    message: str,
    retry_after_ms: int | None = None,
    headers: dict[str, str] | None = None,
    retryable: bool | None = None,
) -> ApiError:
    """A key's limits say no: counted, and the 429 its client gets."""
    gw.count_refused(key, "quota", lane, for_capacity=False)
    return ApiError("RATE_LIMITED", message, retry_after_ms, headers, retryable=retryable)


def budget_spent(
    gw: Gateway,
    key: KeyEntry,
    lane: ModelLane,
    budget: str,
    until_ms: int | None,
    headers: dict[str, str],
) -> ApiError:
    """A key's budget has no room for the request: counted, and a 429 no
    retry helps until the period ends (``Retry-After``: then)."""
    gw.count_refused(key, "budget", lane, for_capacity=False)
    return ApiError(
        "BUDGET_EXCEEDED",
        f"this key's {budget} has no room left for this request; "
        "it starts again when the period ends (UTC)",
        until_ms,
        headers,
        retryable=False,
    )


def budget_held(
    gw: Gateway, key: KeyEntry, lane: ModelLane, budget: str, headers: dict[str, str]
) -> ApiError:
    """A key's budget has no room for the request while its requests in
    flight hold their reservations: counted, and a 429 worth a retry once
    they are answered (they give back what they did not use), after about
    the slowest call the key's requests were in (a batch's time before
    any), a second at most: another key's slow calls may have set either."""
    gw.count_refused(key, "budget", lane, for_capacity=False)
    line = lane.quota.costs.call_line(key.id)
    slowest_ms = line.slowest_us / 1000 if line is not None else lane.fleet.batch_ms()
    return ApiError(
        "RATE_LIMITED",
        f"this key's {budget} is held by its requests in flight: retry when they are answered",
        max(1, min(round(slowest_ms or 100.0), HELD_RETRY_MOST_MS)),
        headers,
    )


def over_share(key: KeyEntry, lane: ModelLane) -> ApiError:
    return ApiError(
        "SERVICE_OVERLOADED",
        f"this key already has its share of the {key.tier} tier waiting: "
        "retry when some of its requests are answered",
        round(lane.fleet.batch_ms() or 100.0),
    )
