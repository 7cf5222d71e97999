"""The Litestar application: routes, the error shape for every failure, and
the OpenAPI document."""

import functools
from dataclasses import dataclass
from importlib.metadata import version
from typing import Annotated, Any

import msgspec
from infergate.base import logs
from infergate.base.metrics import NO_TIER
from infergate.gateway.admin_routes import (
    admin_budgets,
    admin_only,
    admin_policy,
    admin_usage,
    authorization_of,
    dead_letters,
    error_spec,
    purge_dead_letters,
    reload_policy,
    status,
)
from infergate.gateway.api import (
    InferenceResponse,
    JobAccepted,
    JobView,
    ModelList,
    Readiness,
    inference_request_body,
)
from infergate.gateway.calls import Call, OnDisconnect, call_from
from infergate.gateway.errors import ERRORS, JSON, ApiError, Headers, render
from infergate.gateway.fast_route import FastRoute
from infergate.gateway.inference import Inference
from infergate.gateway.jobs import Jobs
from infergate.gateway.middleware import ON_DISCONNECT, REQUEST_ID, RequestIdAndLimits
from infergate.gateway.openai_routes import (
    CHAT_PATH,
    OPENAI_PATHS,
    answer_openai,
    get_model,
    model_card,
    post_chat,
    post_completions,
)
from infergate.gateway.operators import Operators
from infergate.gateway.service import Gateway
from litestar import Litestar, Request, Response, Router, delete, get, post
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin
from litestar.openapi.spec import Components, Operation, SecurityScheme
from litestar.params import Parameter
from litestar.status_codes import HTTP_200_OK, HTTP_202_ACCEPTED, HTTP_503_SERVICE_UNAVAILABLE

log = logs.get(__name__)

_HTTP_CODES = {
    400: "INVALID_INPUT",
    401: "UNAUTHENTICATED",
    403: "FORBIDDEN",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "PAYLOAD_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    429: "RATE_LIMITED",
    503: "SERVICE_OVERLOADED",
}


INFERENCE_ERRORS = {
    ERRORS[code][0]: error_spec(text)
    for code, text in (
        (
            "INVALID_INPUT",
            "INVALID_INPUT: the body is not the schema, or the input is empty or too long",
        ),
        ("UNAUTHENTICATED", "UNAUTHENTICATED: no or unknown API key"),
        (
            "KEY_DISABLED",
            "KEY_DISABLED: the key is disabled; FORBIDDEN: it may not use the model it names",
        ),
        ("MODEL_NOT_FOUND", "MODEL_NOT_FOUND: the policy serves no model of that name"),
        ("PAYLOAD_TOO_LARGE", "PAYLOAD_TOO_LARGE: the body is over the byte limit"),
        (
            "RATE_LIMITED",
            "RATE_LIMITED: the key's quota is spent (Retry-After); "
            "BUDGET_EXCEEDED: its budget for the period is (no retry until it ends)",
        ),
        ("INFERENCE_FAILED", "INFERENCE_FAILED: the backend failed on this input"),
        (
            "SERVICE_OVERLOADED",
            "SERVICE_OVERLOADED: no capacity, no healthy worker, or Redis unreachable",
        ),
        ("TIMEOUT", "TIMEOUT: the deadline passed before a reply"),
    )
}


def _request_id(request: Request[Any, Any, Any]) -> str:
    return str(request.scope.get(REQUEST_ID, ""))


def _gateway(request: Request[Any, Any, Any]) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _jobs(request: Request[Any, Any, Any]) -> Jobs:
    jobs: Jobs = request.app.state.jobs
    return jobs


@dataclass
class _InferenceOperation(Operation):
    """The handler reads its body itself (the key is checked before the body
    is parsed, and strictly): the document still shows the body's schema."""

    def __post_init__(self) -> None:
        self.request_body = inference_request_body()


# The inference route, defined once: the OpenAPI document's handler, the
# ASGI path and the edge's fast route (``fast_routes``) all serve it with
# ``answer_inference``.
INFERENCE_PATH = "/v1/inference"


@post(
    INFERENCE_PATH,
    status_code=HTTP_200_OK,
    responses=INFERENCE_ERRORS,
    summary="Run one input through the model",
    description="Waits on this connection until the result is ready or the deadline passes.",
    security=[{"bearer": []}],
    operation_class=_InferenceOperation,
)
async def post_inference(request: Request[Any, Any, Any]) -> Response[InferenceResponse]:
    """The route through ASGI (a request with a query string, or a server
    without the edge); the edge serves the rest itself (``fast_routes``)."""
    status, headers, payload = await answer_inference(
        request.app.state.inference,
        _request_id(request),
        list(request.scope["headers"]),
        await request.body(),
        request.scope.get(ON_DISCONNECT),  # type: ignore[arg-type]
    )
    return _raw_response(status, headers, payload)


def _raw_response(status: int, headers: Headers, payload: bytes) -> Response[Any]:
    """A response whose body is already JSON bytes (content-type among ``headers``)."""
    return Response(
        payload,
        status_code=status,
        headers={k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k != JSON[0]},
        media_type=JSON[1].decode(),
    )


async def answer_inference(
    inference: Inference,
    request_id: str,
    headers: Headers,
    body: bytes,
    on_disconnect: OnDisconnect | None,
) -> tuple[int, Headers, bytes]:
    """POST /v1/inference: its status, headers (all but content-length and
    x-request-id) and body, in the one error shape when it fails. The edge
    serves it straight from the connection, skipping Litestar's routing,
    signature model and response machinery."""
    call = call_from(request_id, headers, body, on_disconnect)
    try:
        result, extra = await inference.infer(call)
    except ApiError as exc:
        if exc.status < 500:
            logs.limited(log, "request.refused", status=exc.status, code=exc.code)
        return render(exc, request_id)
    except Exception as exc:
        log.exception("request.unexpected_error", request_id=request_id, error=type(exc).__name__)
        return render(ApiError("INTERNAL", "internal error"), request_id)
    head = [JSON, *((k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items())]
    return HTTP_200_OK, head, msgspec.json.encode(result)


JOB_ERRORS = {
    404: error_spec(
        "NOT_FOUND: no such job (or it expired, or it is another key's); "
        "MODEL_NOT_FOUND: no such model (a submit)"
    ),
    **{k: v for k, v in INFERENCE_ERRORS.items() if k in (400, 401, 403, 413, 429, 503)},
}


@post(
    "/v1/jobs",
    status_code=HTTP_202_ACCEPTED,
    responses=JOB_ERRORS,
    summary="Submit an input to run in spare capacity; fetch the result later",
    description="Returns at once with the job's id and its Location. The same body as "
    "/v1/inference; timeout_ms can only shorten the tier's job deadline.",
    security=[{"bearer": []}],
    operation_class=_InferenceOperation,
)
async def submit_job(request: Request[Any, Any, Any]) -> Response[JobAccepted]:
    call = Call(_request_id(request), authorization_of(request), await request.body())
    accepted, headers = await _jobs(request).submit(call)
    return Response(accepted, status_code=HTTP_202_ACCEPTED, headers=headers)


@get(
    "/v1/jobs/{job_id:str}",
    responses=JOB_ERRORS,
    summary="A job: queued, running, succeeded, failed, cancelled or expired",
    description="With wait_s (at most 20), answers when the job has finished or after that "
    "many seconds, whichever comes first.",
    security=[{"bearer": []}],
)
async def fetch_job(
    request: Request[Any, Any, Any],
    job_id: str,
    wait_s: Annotated[float, Parameter(ge=0, le=20, description="long poll, seconds")] = 0.0,
) -> JobView:
    on_disconnect: OnDisconnect | None = request.scope.get(ON_DISCONNECT)  # type: ignore[assignment]
    return await _jobs(request).fetch(authorization_of(request), job_id, wait_s, on_disconnect)


@delete(
    "/v1/jobs/{job_id:str}",
    status_code=HTTP_200_OK,
    responses={**JOB_ERRORS, 409: error_spec("CONFLICT: the job has started or finished")},
    summary="Cancel a queued job (again: nothing changes)",
    security=[{"bearer": []}],
)
async def cancel_job(request: Request[Any, Any, Any], job_id: str) -> JobView:
    return await _jobs(request).cancel(authorization_of(request), job_id)


@get(
    "/v1/models",
    summary="The models this key may use (name one as `model` in a request)",
    responses={401: error_spec("UNAUTHENTICATED: no or unknown API key")},
    security=[{"bearer": []}],
)
async def list_models(request: Request[Any, Any, Any]) -> ModelList:
    gw = _gateway(request)
    policy = gw.policy.current
    key = gw.authenticate(authorization_of(request), policy)
    return ModelList([model_card(gw, name) for name in policy.models if policy.may_use(key, name)])


@get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get(
    "/readyz",
    summary="Redis answers and has room, and at least one worker is alive",
    responses={
        503: ResponseSpec(
            data_container=Readiness, description="not ready", generate_examples=False
        )
    },
)
async def readyz(request: Request[Any, Any, Any]) -> Response[Readiness]:
    gw = _gateway(request)
    ready = gw.ready()
    shards = range(len(gw.shards))
    body = Readiness(
        ready,
        gw.redis_ok(),
        max(gw.workers_alive(i) for i in shards),
        gw.draining,
        any(gw.full(i) for i in shards),
        round(max(gw.memory.use), 4),
        len(shards),
        sum(gw.ready_on(i) for i in shards),
        bool(gw.direct.on_shards),
    )
    return Response(body, status_code=HTTP_200_OK if ready else HTTP_503_SERVICE_UNAVAILABLE)


def _render(request: Request[Any, Any, Any], error: ApiError) -> Response[Any]:
    if error.status < 500:
        # A client's mistake: one line, rate-limited (an attacker can repeat it at will).
        logs.limited(log, "request.refused", status=error.status, code=error.code)
    return _raw_response(*render(error, _request_id(request)))


def _on_api_error(request: Request[Any, Any, Any], exc: ApiError) -> Response[Any]:
    return _render(request, exc)


# Where a value Litestar refused came from, as a client would name it.
_SOURCES = {"query": "query parameter", "path": "path parameter", "header": "header"}


def _on_validation(request: Request[Any, Any, Any], exc: ValidationException) -> Response[Any]:
    detail, what = exc.detail, "request body"
    extra = exc.extra
    if isinstance(extra, list) and extra:
        first = extra[0]
        if isinstance(first, dict):
            source = first.get("source")  # a str (ParamType is a str enum)
            if isinstance(source, str):
                what = _SOURCES.get(source, what)
            where = first.get("key") or ""
            detail = f"{first.get('message', detail)}" + (f" (at {where})" if where else "")
    return _render(request, ApiError("INVALID_INPUT", f"invalid {what}: {detail}"))


def _on_http(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    code = _HTTP_CODES.get(
        exc.status_code, "INTERNAL" if exc.status_code >= 500 else "INVALID_INPUT"
    )
    error = ApiError(code, str(exc.detail))
    response = _render(request, error)
    response.status_code = exc.status_code
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def _on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    log.exception(
        "request.unexpected_error", request_id=_request_id(request), error=type(exc).__name__
    )
    return _render(request, ApiError("INTERNAL", "internal error"))


def create_app(gateway: Gateway, inference: Inference) -> Litestar:
    async def on_startup(app: Litestar) -> None:
        await gateway.start()

    async def on_shutdown(app: Litestar) -> None:
        await gateway.stop()

    app = Litestar(
        route_handlers=[
            post_inference,
            submit_job,
            fetch_job,
            cancel_job,
            list_models,
            get_model,
            post_completions,
            post_chat,
            healthz,
            readyz,
            Router(
                "/",
                route_handlers=[
                    status,
                    admin_policy,
                    admin_usage,
                    admin_budgets,
                    reload_policy,
                    dead_letters,
                    purge_dead_letters,
                ],
                guards=[admin_only],
            ),
        ],
        on_startup=[on_startup],
        on_shutdown=[on_shutdown],
        exception_handlers={
            ApiError: _on_api_error,
            ValidationException: _on_validation,
            HTTPException: _on_http,
            Exception: _on_unexpected,
        },
        # The body's size is limited, live, by the middleware (create_asgi).
        request_max_body_size=None,
        openapi_config=OpenAPIConfig(
            title="infergate",
            version=version("infergate"),
            description="A priority-tiered inference gateway: send one string, get one string back.",
            components=Components(
                security_schemes={
                    "bearer": SecurityScheme(
                        type="http", scheme="bearer", description="Your API key"
                    )
                }
            ),
            render_plugins=[JsonRenderPlugin(), SwaggerRenderPlugin()],
            path="/schema",
        ),
        logging_config=None,
    )
    app.state.gateway = gateway
    app.state.inference = inference
    app.state.operators = Operators(gateway)
    app.state.jobs = Jobs(gateway, inference)
    return app


def count_refused_inference(gateway: Gateway, status: int) -> None:
    """An inference request refused before its key was read (413): no tier."""
    gateway.metrics.requests.labels(NO_TIER, str(status)).inc()


def create_asgi(gateway: Gateway, inference: Inference) -> Any:
    """The Litestar app wrapped in the request-id and body-limit middleware."""

    def count_refused(scope: dict[str, Any], status: int) -> None:
        if scope.get("path") in (INFERENCE_PATH, *OPENAI_PATHS):
            count_refused_inference(gateway, status)

    return RequestIdAndLimits(
        create_app(gateway, inference),
        lambda: gateway.policy.current.document.limits.max_body_bytes,
        count_refused,
    )


def fast_routes(gateway: Gateway, inference: Inference) -> list[FastRoute]:
    """POST /v1/inference and the OpenAI routes' POSTs, for the HTTP edge to
    serve without ASGI."""

    def route(path: str, answer: Any) -> FastRoute:
        async def answer_fast(
            request_id: str, headers: Headers, body: bytes, on_disconnect: OnDisconnect
        ) -> tuple[int, Headers, bytes]:
            status, head, payload = await answer(request_id, headers, body, on_disconnect)
            head.append((b"x-request-id", request_id.encode()))
            return status, head, payload

        return FastRoute(
            b"POST",
            path.encode(),
            answer_fast,
            lambda: gateway.policy.current.document.limits.max_body_bytes,
            lambda status: count_refused_inference(gateway, status),
            gateway.edge_failed,
        )

    return [
        route(INFERENCE_PATH, functools.partial(answer_inference, inference)),
        *(
            route(path, functools.partial(answer_openai, inference, path == CHAT_PATH))
            for path in OPENAI_PATHS
        ),
    ]
