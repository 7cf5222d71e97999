"""A parked request's wait: its reply, or 504 at its deadline, or its
client leaving (the request is withdrawn: take drops it), or its queue lost
with a Redis that restarted empty (503, to be retried): one timer, and the
edge's disconnect callback, no task per request. A request given up on
leaves what it reserved beside it: the take that drops it unrun gives it
back (past its deadline, in the background: a Redis that stalls holds no
504 back)."""

import asyncio
from collections.abc import Sequence

from infergate.base import logs, wire
from infergate.base.errors import STORE_ERRORS
from infergate.base.loops import Background
from infergate.base.queue.gateway import Counter, GatewayQueue
from infergate.gateway.calls import OnDisconnect
from infergate.gateway.errors import RETRY_REDIS_MS, ApiError
from infergate.gateway.replies import QueueLost

log = logs.get(__name__)
# Give-backs of requests past their deadline, under way.
_giving_back = Background("request.leave_reserved_failed")


class ClientGone(Exception):
    """The client closed its connection while its request waited."""


def _fail(future: "asyncio.Future[wire.Result]", error: type[Exception]) -> None:
    if not future.done():
        future.set_exception(error())


async def wait_for_reply(
    queue: GatewayQueue,
    future: asyncio.Future[wire.Result],
    envelope: wire.Envelope,
    remaining_s: float,
    on_disconnect: OnDisconnect | None,
    reserved: Sequence[tuple[Counter, int, int]] = (),
    *,
    deadline_ms: int,
) -> wire.Result:
    """The request's reply, or 504 at its deadline, or a cancel if the
    client leaves: one timer, and the edge's disconnect callback.
    ``reserved``: what it reserved (``GatewayQueue.leave_reserved``);
    ``deadline_ms``: the deadline it was given, as its 504 says it (not
    what was left of it when it queued)."""
    timer = asyncio.get_running_loop().call_later(
        max(0.0, remaining_s), _fail, future, TimeoutError
    )
    if on_disconnect is not None:
        on_disconnect(lambda: _fail(future, ClientGone))
    try:
        return await future
    except TimeoutError:
        if reserved:  # (in the background: a Redis that stalls holds no 504 past its deadline)
            _giving_back.run(leave_reserved(queue, envelope, reserved))
        raise ApiError("TIMEOUT", f"no result within the {deadline_ms} ms deadline") from None
    except ClientGone:
        await cancel(queue, envelope, reserved)
        raise ApiError("CLIENT_CLOSED", "the client disconnected") from None
    except QueueLost:
        raise ApiError(
            "SERVICE_OVERLOADED",
            "the queue store restarted without its contents while the request waited; retry",
            RETRY_REDIS_MS,
        ) from None
    except asyncio.CancelledError:  # (another prompt of its call failed)
        await cancel(queue, envelope, reserved)
        raise
    finally:
        timer.cancel()
        if on_disconnect is not None:
            on_disconnect(None)


async def cancel(
    queue: GatewayQueue,
    envelope: wire.Envelope,
    reserved: Sequence[tuple[Counter, int, int]] = (),
) -> None:
    """The client left: mark the request so ``take`` drops it (and its
    long input) before a worker sees it, and gives back what it
    ``reserved``. One already in a batch runs; its input goes with the
    answer, and its reservation is kept."""
    request_id = envelope.id
    try:
        await queue.cancel(request_id, envelope.deadline_ms, reserved)
        log.info("request.cancelled", request_id=request_id)
    except STORE_ERRORS as exc:
        logs.limited(log, "request.cancel_failed", level="warning", error=type(exc).__name__)


async def leave_reserved(
    queue: GatewayQueue, envelope: wire.Envelope, reserved: Sequence[tuple[Counter, int, int]]
) -> None:
    """Past its deadline: what it reserved, for the take that drops it as expired."""
    try:
        await queue.leave_reserved(envelope.id, envelope.deadline_ms, reserved)
    except STORE_ERRORS as exc:  # (kept: never over)
        logs.limited(
            log, "request.leave_reserved_failed", level="warning", error=type(exc).__name__
        )
