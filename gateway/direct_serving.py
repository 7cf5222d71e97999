"""A request served in direct mode (``direct.py``: Redis unreachable, the
policy's ``direct.tiers``): within the gateway's cap and its own count of
the key's quotas, by the model's server, never past a budget (counted in
Redis alone: 503 meanwhile)."""

from infergate.base import clock, wire
from infergate.gateway import reservations
from infergate.gateway.api import InferenceRequest
from infergate.gateway.charging import check_reservation, quota_refused
from infergate.gateway.direct import RETRY_DIRECT_MS, Batcher
from infergate.gateway.errors import ApiError
from infergate.gateway.models import ModelLane
from infergate.gateway.quota import budget_of
from infergate.gateway.service import Gateway
from infergate.policies import KeyEntry, Tier


async def serve_directly(
    gw: Gateway,
    lane: ModelLane,
    key: KeyEntry,
    tier: Tier,
    body: InferenceRequest,
    batcher: Batcher,
) -> wire.Result:
    """A request served in direct mode (``direct.py``): within the gateway's
    cap and its own count of the key's quotas, by the model's server."""
    if gw.direct.started(lane.shard):
        gw.metrics.direct_mode.set(1)
    policy = gw.policy.current.for_model(lane.name)
    doc = policy.document
    params = body.parameters
    if params is not None and params.temperature:
        raise ApiError(
            "SERVICE_OVERLOADED",
            "Redis is unreachable: this gateway serves greedy requests only meanwhile "
            "(send parameters.temperature 0, or retry)",
            RETRY_DIRECT_MS,
        )
    if gw.direct.held() >= doc.direct.max_requests:
        gw.count_refused(key, "direct_full", lane, for_capacity=False)
        raise ApiError(
            "SERVICE_OVERLOADED",
            "Redis is unreachable and this gateway holds all the requests it serves "
            "itself meanwhile (direct.max_requests); retry",
            RETRY_DIRECT_MS,
        )
    if budget_of(key, tier) is not None:  # (a budget's spend is in Redis alone)
        raise ApiError(
            "SERVICE_OVERLOADED",
            "Redis is unreachable, and this key's budget is counted there: retry",
            RETRY_DIRECT_MS,
        )
    max_tokens = (params.max_tokens or 0) if params is not None else 0
    tokens = 0
    if lane.quota.reserves_tokens(key, tier):  # (reserved whole: nothing is settled here)
        max_tokens = reservations.output_bound(max_tokens, policy.models[lane.name])
        tokens = reservations.input_bound(body.input) + max_tokens
        check_reservation(gw, lane, key, tier, len(body.input), tokens)
    refused = gw.direct.quota.charge(key, lane.quota.charges(key, tier, len(body.input), tokens))
    if refused is not None:
        limit, retry_after_ms = refused
        raise quota_refused(
            gw,
            key,
            lane,
            f"rate limit {limit.what} exceeded for this key "
            "(counted by this gateway alone while Redis is unreachable)",
            retry_after_ms,
        )
    gw.metrics.direct_requests.labels(key.tier).inc()
    deadline_ms = (
        tier.deadline_ms if body.timeout_ms is None else min(tier.deadline_ms, body.timeout_ms)
    )
    return await batcher.infer(
        body.input,
        key.tier,
        max_tokens,
        clock.now_ms() + deadline_ms,
        doc.workers.concurrency,
        doc.batching.max_batch_size,
    )
