"""The checks of a request before it is let in: its input against its tier,
its parameters against its model, and the room its model's fleet has for its
tier (a local estimate, no Redis round trip)."""

from infergate.gateway.api import Parameters
from infergate.gateway.errors import ApiError, redis_full, redis_memory_high, redis_unreachable
from infergate.gateway.models import ModelLane
from infergate.gateway.service import Gateway
from infergate.policies import KeyEntry, Policy, Tier
from infergate.policies.backends import MAX_TOKENS, SAMPLING, generates_up_to
from infergate.policies.schema import Model

RETRY_NO_WORKER_MS = 1_000


def check_input(text: str, tier_name: str, tier: Tier) -> None:
    if not text:
        raise ApiError("INVALID_INPUT", "input must be a non-empty string")
    if len(text) > tier.max_input_chars:
        raise ApiError(
            "INVALID_INPUT",
            f"input is {len(text)} characters; the {tier_name} tier allows {tier.max_input_chars}",
        )


def check_parameters(params: Parameters | None, lane: ModelLane, model: Model) -> None:
    """What a model cannot do for this request is a 400 that says so: more
    tokens than it generates, or what its workers' backend lacks (their
    heartbeats say: a function without ``infer_sampled`` does not sample)."""
    if params is None:
        return
    name = lane.name
    if params.temperature and lane.fleet.lacks(SAMPLING):
        raise ApiError(
            "INVALID_INPUT",
            f"the model {name!r} does not sample: send parameters.temperature 0 (or none)",
        )
    if params.max_tokens is None:
        return
    if lane.fleet.lacks(MAX_TOKENS):
        raise ApiError(
            "INVALID_INPUT",
            f"the model {name!r} cannot stop at a number of tokens: send no parameters.max_tokens",
        )
    most = generates_up_to(model)
    if most is not None and params.max_tokens > most:
        raise ApiError(
            "INVALID_INPUT",
            f"parameters.max_tokens {params.max_tokens} is over the {most} "
            f"new tokens the model {name!r} generates",
        )


async def fit_fleet(params: Parameters | None, lane: ModelLane, model: Model) -> None:
    """``check_parameters`` on the lane's fleet view read fresh (at rest it
    is seconds old, and what the workers lack may have changed since); on
    the view it had if that read fails, so a 400 stays one when Redis does
    not answer. A request that asks nothing of the workers reads nothing."""
    if params is None:
        return
    try:
        check_parameters(params, lane, model)
        refused = None
    except ApiError as exc:
        refused = exc
    await lane.fleet.fresh()
    if lane.fleet.snapshot is not None:
        check_parameters(params, lane, model)
    elif refused is not None:
        raise refused


def check_serving(gw: Gateway, lane: ModelLane, key: KeyEntry) -> None:
    """Redis has room (below the tier's high-water mark) and answers, and
    a worker of the model is there."""
    if lane.store.full:
        gw.count_refused(key, "redis_full", lane, for_capacity=False)
        raise redis_full()
    if not gw.ready_for_replies(lane.shard):
        gw.count_refused(key, "redis", lane, for_capacity=False)
        raise redis_unreachable()
    check_memory(gw, lane.shard, key, lane)
    if lane.fleet.workers_alive == 0:
        gw.count_refused(key, "no_worker", lane)
        raise ApiError(
            "SERVICE_OVERLOADED",
            f"no healthy worker of the model {lane.name!r} is available",
            RETRY_NO_WORKER_MS,
        )


def check_memory(gw: Gateway, shard: int, key: KeyEntry, lane: ModelLane | None) -> None:
    """``shard``'s Redis is below ``key``'s tier's high-water mark."""
    use = gw.memory.refuses(shard, key.tier)
    if use is not None:
        gw.count_refused(key, "redis_memory", lane, for_capacity=False)
        raise redis_memory_high(use, key.tier)


def check_capacity(gw: Gateway, lane: ModelLane, policy: Policy, key: KeyEntry) -> float:
    """Redis and a worker are there, and the tier has room within its
    budget: how many of its requests may wait (its allowance; a key's
    share of it is checked with the charge, ``admit.lua``). A local
    estimate with no Redis round trip, made before the quota is charged,
    so under overload a refusal costs next to nothing."""
    check_serving(gw, lane, key)
    tier_name = key.tier
    decision = lane.admission.decide(policy, tier_name)
    if not decision.admitted:
        gw.count_refused(key, "capacity", lane)
        budget_ms = policy.tiers[tier_name].latency_budget_ms
        raise ApiError(
            "SERVICE_OVERLOADED",
            f"the {tier_name} tier is at capacity: about {decision.wait_ms:.0f} ms of work is "
            f"queued ahead, over its {budget_ms} ms budget",
            decision.retry_after_ms,
        )
    lane.admission.admitted(tier_name)
    return decision.allowance
