"""The operators' routes (an admin key): the policy, the dead letters, usage
per key and the fleet at a glance, each for one model (``?model=``; default:
the policy's default model)."""

from typing import Annotated, Any

from infergate.base.queue.dead_letters import MAX_LISTED
from infergate.base.queue.usage import By as UsageBy
from infergate.base.queue.usage import Order as UsageOrder
from infergate.gateway.api import (
    AdminPolicy,
    BudgetReport,
    DeadLetters,
    DeadLettersPurged,
    ReloadResult,
    StatusResponse,
    UsageReport,
)
from infergate.gateway.auth import one_authorization
from infergate.gateway.errors import ErrorBody
from infergate.gateway.operators import Operators
from litestar import Request, delete, get, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter
from litestar.status_codes import HTTP_200_OK

MODEL = Annotated[
    str | None, Parameter(max_length=200, description="the model (default: the policy's)")
]
SHARD = Annotated[
    int,
    Parameter(ge=0, le=63, description="the Redis shard, 0 first (a deployment of several)"),
]


def error_spec(description: str) -> ResponseSpec:
    return ResponseSpec(data_container=ErrorBody, description=description, generate_examples=False)


def _operators(request: Request[Any, Any, Any]) -> Operators:
    operators: Operators = request.app.state.operators
    return operators


def authorization_of(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    return one_authorization(connection.headers.getall("authorization", []))


def admin_only(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """The guard of every operator endpoint: an admin key (401, 403)."""
    operators: Operators = connection.app.state.operators
    operators.admin(authorization_of(connection))


ADMIN_ERRORS = {
    401: error_spec("UNAUTHENTICATED: no or unknown API key"),
    403: error_spec("FORBIDDEN: not an admin key"),
    404: error_spec("MODEL_NOT_FOUND: no such model is served; NOT_FOUND: no such shard"),
}


@get(
    "/v1/admin/policy",
    summary="The active policy (without key digests)",
    responses=ADMIN_ERRORS,
    security=[{"bearer": []}],
)
async def admin_policy(request: Request[Any, Any, Any]) -> AdminPolicy:
    return _operators(request).admin_policy()


@post(
    "/v1/admin/policy/reload",
    status_code=HTTP_200_OK,
    summary="Re-read the policy file now",
    description="An invalid file changes nothing; the response says why.",
    responses=ADMIN_ERRORS,
    security=[{"bearer": []}],
)
async def reload_policy(request: Request[Any, Any, Any]) -> ReloadResult:
    return await _operators(request).reload_policy()


@get(
    "/v1/admin/dead-letters",
    summary="Batches given up on: sizes, tiers and why, never their inputs",
    responses=ADMIN_ERRORS,
    security=[{"bearer": []}],
)
async def dead_letters(
    request: Request[Any, Any, Any],
    limit: Annotated[
        int, Parameter(ge=1, le=MAX_LISTED, description="newest first (and at most 8 MB)")
    ] = 20,
    model: MODEL = None,
    shard: SHARD = 0,
) -> DeadLetters:
    return await _operators(request).dead_letters(limit, model, shard)


@delete(
    "/v1/admin/dead-letters",
    status_code=HTTP_200_OK,
    summary="Empty the dead-letter list",
    responses=ADMIN_ERRORS,
    security=[{"bearer": []}],
)
async def purge_dead_letters(
    request: Request[Any, Any, Any], model: MODEL = None, shard: SHARD = 0
) -> DeadLettersPurged:
    return await _operators(request).purge_dead_letters(model, shard)


@get(
    "/v1/admin/usage",
    summary="What each key used: answered requests, input characters and tokens, output "
    "tokens, GPU time, refusals",
    description="Kept per hour for the policy's usage.retention_days; a key's GPU time is "
    "its requests' shares of the backend calls that ran them; tokens are the model's. "
    "by=hour or by=day gives a row per key and period (UTC), for billing.",
    responses={**ADMIN_ERRORS, 400: error_spec("INVALID_INPUT: since, sort or by is not valid")},
    security=[{"bearer": []}],
)
async def admin_usage(
    request: Request[Any, Any, Any],
    key_id: Annotated[str | None, Parameter(max_length=256, description="one key only")] = None,
    since: Annotated[
        str | None,
        Parameter(max_length=64, description="epoch seconds or ISO 8601; default: a day ago"),
    ] = None,
    sort: Annotated[UsageOrder, Parameter(description="most first")] = "gpu_ms",
    by: Annotated[
        UsageBy, Parameter(description="all: a row per key; hour, day: per key and period")
    ] = "all",
    model: MODEL = None,
) -> UsageReport:
    return await _operators(request).usage(key_id, since, sort, model, by)


@get(
    "/v1/admin/budgets",
    summary="Each key's budgets in their current periods: spent and left",
    description="Spent counts the answered requests' use and the reservations of those in "
    "flight; a period ends on Redis's clock (UTC).",
    responses=ADMIN_ERRORS,
    security=[{"bearer": []}],
)
async def admin_budgets(
    request: Request[Any, Any, Any],
    key_id: Annotated[str | None, Parameter(max_length=256, description="one key only")] = None,
) -> BudgetReport:
    return await _operators(request).budgets(key_id)


@get(
    "/v1/status",
    summary="Workers, queues, batching and the policy at a glance (admin key)",
    responses=ADMIN_ERRORS,
    security=[{"bearer": []}],
)
async def status(
    request: Request[Any, Any, Any], model: MODEL = None, shard: SHARD = 0
) -> StatusResponse:
    return await _operators(request).status(model, shard)
