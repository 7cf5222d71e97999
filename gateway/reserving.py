"""What a request reserves of its key's token limits and budgets, and
what becomes of it: settled by what its answer used (which teaches its
key's costs), all of it given back if it failed, or, for a request given
up on while it ran, settled by its reply when that comes late."""

from infergate.base import clock, wire
from infergate.base.queue.gateway import RESERVED_KEPT_MS, Counter
from infergate.gateway import reservations
from infergate.gateway.api import Parameters
from infergate.gateway.charging import check_reservation, gpu_reservation, settle
from infergate.gateway.costs import MeasuredCall
from infergate.gateway.models import ModelLane
from infergate.gateway.request import Request
from infergate.gateway.service import Gateway
from infergate.policies import KeyEntry, Tier
from infergate.policies.schema import Model


def answer_cut(
    lane: ModelLane, key: KeyEntry, tier: Tier, params: Parameters | None, model: Model
) -> int:
    """The output tokens a request's answer is cut to where it reserves
    them (``reserve``); 0 where it reserves none."""
    if not (lane.quota.reserves_tokens(key, tier) or lane.quota.reserves_gpu(key, tier)):
        return 0
    asked = (params.max_tokens or 0) if params is not None else 0
    return reservations.output_bound(asked, model)


def reserve(gw: Gateway, request: Request, cut_to: int, whole: bool) -> None:
    """What the request reserves of its key's token limits and budgets, if
    it reserves (``cut_to``, from ``answer_cut``: the worker cuts its output to
    what was reserved for it, and counts its input), 429 if that can never
    fit (``whole``: not one of a list, which is checked as a whole)."""
    lane, key, tier = request.lane, request.key, request.tier
    if cut_to:
        request.input_bound = reservations.input_bound(request.text, request.conversation)
        request.max_tokens = cut_to
        request.reserve = request.input_bound + request.max_tokens
        request.count_input = True
    if cut_to and lane.quota.reserves_gpu(key, tier):
        request.reserve_gpu_us = gpu_reservation(lane, key, request.input_bound, request.max_tokens)
    if whole and (request.reserve or request.reserve_gpu_us):
        size = len(request.text)
        check_reservation(gw, lane, key, tier, size, request.reserve, request.reserve_gpu_us)


def measured(request: Request, result: wire.Result, gpu_us: int) -> None:
    """What the request's answer teaches its key's costs (``costs.py``):
    its call, and its bounds (what it reserved, or else its input's and
    answer's size)."""
    text = request.text
    bound = (request.input_bound, request.max_tokens)
    if not request.reserve:
        bound = (len(text) + reservations.TEMPLATE_TOKENS, result.tokens)
    call = MeasuredCall.of(result)
    request.lane.quota.costs.answered(request.key.id, len(text), gpu_us, call, bound)


async def settle_failed(request: Request) -> None:
    """A request that failed (its batch ran, it was not answered) used
    nothing it is charged for: all it reserved goes back, once."""
    reservation, request.reservation = request.reservation, None
    await settle(request.lane, reservation, 0, 0)


def settle_when_answered(gw: Gateway, request: Request, deadline_ms: int) -> None:
    """A request given up on (past its deadline, its client gone, its
    list failed) gives back what it reserved when the take that drops it
    unrun does (``waiting.py``); one already running settles by its reply,
    if that comes while its give-back would have been kept: never both."""
    lane, reservation = request.lane, request.reservation
    if reservation is None:
        return

    async def answered(result: wire.Result) -> None:
        if result.error is not None:
            await settle(lane, reservation, 0, 0)
            return
        gpu_us = reservations.gpu_used(result)
        measured(request, result, gpu_us)
        await settle(lane, reservation, reservations.used(result, request.input_bound), gpu_us)

    kept_s = (max(deadline_ms - clock.now_ms(), 0) + RESERVED_KEPT_MS) / 1000
    gw.replies.on_late(request.id, clock.monotonic_s() + kept_s, answered)


def reserved_by(request: Request) -> list[tuple[Counter, int, int]]:
    """What the request reserved, as a give-back leaves it."""
    return request.reservation.unused(0, 0) if request.reservation else []


def left_for_take(request: Request) -> list[tuple[Counter, int, int]]:
    """What a request cancelled as it was admitted leaves for the take that
    drops it: one charged already (one of a list, a follower that runs on
    its own) that may have queued, what it reserved (one of a list that did
    not goes back with it: ``prompt_lists.withdraw``); a request whose admit
    charges and queues in one step, nothing (its reservation is set as the
    admit answers)."""
    listed = request.charged
    if listed is not None and request.id in listed.unused and request.id not in listed.sending:
        return []
    return reserved_by(request)
