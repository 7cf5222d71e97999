"""The OpenAI-compatible routes: POST /v1/completions and /v1/chat/completions,
and GET /v1/models/{id}, so that the official client and what is built on it
work against the gateway.

Each prompt is one request down the same path as POST /v1/inference
(admission, quotas, priority, collapsing, the cache, metrics and traces),
and the edge serves the two POSTs itself as it serves that one. The key is
checked before the body is parsed; errors are in OpenAI's shape.
"""

import asyncio
import dataclasses
import time
from typing import Any

from infergate.base import clock, logs
from infergate.base.metrics import NO_TIER
from infergate.gateway import prompt_lists
from infergate.gateway.admin_routes import authorization_of, error_spec
from infergate.gateway.api import (
    InferenceRequest,
    InferenceResponse,
    ModelCard,
    request_body,
)
from infergate.gateway.calls import Call, Fanout, OnDisconnect, call_from
from infergate.gateway.checks import check_serving, fit_fleet
from infergate.gateway.errors import ApiError, Headers
from infergate.gateway.inference import Inference
from infergate.gateway.middleware import ON_DISCONNECT, REQUEST_ID
from infergate.gateway.openai_answers import (
    ChatCompletion,
    Completion,
    OpenAIError,
    Reply,
    render_openai,
)
from infergate.gateway.openai_api import (
    Ask,
    ChatRequest,
    CompletionRequest,
    read_chat,
    read_completion,
)
from infergate.gateway.prompt_lists import ListCharge
from infergate.gateway.service import Gateway
from infergate.policies import KeyEntry, Policy
from infergate.policies.backends import generates_up_to
from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation, Schema

log = logs.get(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
OPENAI_PATHS = (COMPLETIONS_PATH, CHAT_PATH)


async def answer_openai(
    inference: Inference,
    chat: bool,
    request_id: str,
    headers: Headers,
    body: bytes,
    on_disconnect: OnDisconnect | None,
) -> tuple[int, Headers, bytes]:
    """A completion or chat completion: its status, headers and body (an
    error in OpenAI's shape). Never raises."""
    call = call_from(request_id, headers, body, on_disconnect)
    gw, ask = inference.gw, None
    try:
        policy = gw.policy.current
        key = gw.authenticate(call.authorization, policy)  # (before the body is parsed)
        try:
            if chat:
                ask = read_chat(body, policy.document.openai.chat_template)
            else:
                ask = read_completion(body)
        except ApiError as exc:
            gw.metrics.requests.labels(key.tier, str(exc.status)).inc()
            raise
        responses, extra = await _infer_all(inference, call, ask, key, policy)
    except ApiError as exc:
        if ask is None and exc.code in ("UNAUTHENTICATED", "KEY_DISABLED", "FORBIDDEN"):
            gw.metrics.requests.labels(NO_TIER, str(exc.status)).inc()
        if exc.status < 500:
            logs.limited(log, "request.refused", status=exc.status, code=exc.code)
        # (an input the tier refuses is the prompt's or the messages' fault)
        read = ask is not None and exc.code == "INVALID_INPUT"
        where = ("messages" if chat else "prompt") if read else None
        return render_openai(exc, request_id, where)
    except Exception as exc:
        log.exception("request.unexpected_error", request_id=request_id, error=type(exc).__name__)
        return render_openai(ApiError("INTERNAL", "internal error"), request_id, None)
    limit = _limit(ask, policy, responses[0].model)
    head, payload = Reply(ask, request_id, int(time.time()), responses, limit).body()
    head += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    return 200, head, payload


def _limit(ask: Ask, policy: Policy, model: str | None) -> int | None:
    """The most tokens each output could have: the request's max_tokens, or
    the model's own bound where infergate sets it (None: unknown)."""
    if ask.parameters is not None and ask.parameters.max_tokens is not None:
        return ask.parameters.max_tokens
    entry = policy.models.get(model or "")
    return generates_up_to(entry) if entry is not None else None


async def _infer_all(
    inference: Inference, call: Call, ask: Ask, key: KeyEntry, policy: Policy
) -> tuple[list[InferenceResponse], dict[str, str]]:
    """Each prompt as one request, all at once, under one hold on the key's
    connections; the first failure cancels the others (their queued
    requests too) and fails the call."""
    requests = ask.requests()
    if len(requests) == 1:
        one = _one(call, requests[0], call.request_id, conversation=ask.conversation)
        response, headers = await inference.infer(one)
        return [response], headers
    ids = [f"{call.request_id}-{i}" for i in range(len(requests))]
    holds = inference.gw.holds
    try:
        # One unit (prompt_lists.py): every prompt checked, then all charged at once.
        checked = [inference.read_body(r, policy, key) for r in requests]
        _, tier, lane = checked[0]
        for body, _, _ in checked:
            await fit_fleet(body.parameters, lane, policy.models[lane.name])
        check_serving(inference.gw, lane, key)  # (before the charge: a refusal costs nothing)
        holds.acquire(key.id, policy.document.limits.key_connection_share)
        try:
            charged = await prompt_lists.charge(
                inference.gw,
                lane,
                key,
                tier,
                {i: r.input for i, r in zip(ids, requests, strict=True)},
                (ask.parameters.max_tokens or 0) if ask.parameters is not None else 0,
            )
        except BaseException:
            holds.release(key.id)
            raise
    except ApiError as exc:
        exc.tier = key.tier
        inference.count_refused(exc)
        raise
    fanout = None if call.on_disconnect is None else Fanout(call.on_disconnect)
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(
                    inference.infer(
                        _one(
                            call,
                            request,
                            ids[i],
                            None if fanout is None else fanout.hook_of(i),
                            held=True,
                            charged=charged,
                        )
                    )
                )
                for i, request in enumerate(requests)
            ]
    except BaseExceptionGroup as failed:
        until_ms = clock.now_ms() + tier.deadline_ms
        await prompt_lists.withdraw(lane, key, tier, ids, until_ms, charged)
        raise _first_error(failed) from None
    finally:
        holds.release(key.id)
        if fanout is not None:
            fanout.close()
    outcomes = [task.result() for task in tasks]
    return [response for response, _ in outcomes], outcomes[-1][1]


def _first_error(failed: BaseExceptionGroup[BaseException]) -> BaseException:
    """The group's API error (the client's answer), else its first exception."""
    for exc in failed.exceptions:
        if isinstance(exc, ApiError):
            return exc
    return failed.exceptions[0]


def _one(
    call: Call,
    request: InferenceRequest,
    request_id: str,
    hook: OnDisconnect | None = None,
    *,
    held: bool = False,
    charged: ListCharge | None = None,
    conversation: str | None = None,
) -> Call:
    """One prompt's call: its own request id, its body read, its input
    counted (and, one of several, its own disconnect hook, and the list's
    quota charged already)."""
    return dataclasses.replace(
        call,
        request_id=request_id,
        request=request,
        count_input=True,
        held=held,
        on_disconnect=hook if held else call.on_disconnect,
        charged=charged,
        conversation=conversation,
    )


# -- through ASGI (a query string, or a server without the edge) -------------


def _raw(status: int, headers: Headers, payload: bytes) -> Response[Any]:
    # (the media type alone: Litestar adds the charset of a text type itself)
    content_type = dict(headers).get(b"content-type", b"application/json").decode()
    content_type = content_type.split(";")[0]
    return Response(
        payload,
        status_code=status,
        headers={
            k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k != b"content-type"
        },
        media_type=content_type,
    )


_ERRORS = {
    status: ResponseSpec(data_container=OpenAIError, description=text, generate_examples=False)
    for status, text in (
        (400, "invalid_input: a field the backend cannot honour is named in param"),
        (401, "unauthenticated: no or unknown API key, or an invalid token"),
        (403, "key_disabled, or forbidden: a model or tier this caller may not use"),
        (404, "model_not_found"),
        (429, "rate_limited (retry-after; x-should-retry: false when it resets later)"),
        (500, "inference_failed: the backend failed on this input"),
        (503, "service_overloaded"),
        (504, "timeout"),
    )
}
# Refused by the edge before the route reads the body: the gateway's own shape.
_ERRORS[413] = error_spec("PAYLOAD_TOO_LARGE: the body is over the byte limit")


# With stream: true, the answer as Server-Sent Events: each event's fields.
STREAM = Schema(
    type=OpenAPIType.OBJECT,
    description="One Server-Sent Event: `data` is a chunk's JSON, the last one `[DONE]`.",
    properties={
        "data": Schema(type=OpenAPIType.STRING),
        "event": Schema(type=OpenAPIType.STRING),
    },
)


def _operation(struct: type) -> type[Operation]:
    @dataclasses.dataclass
    class _Documented(Operation):
        """The handler reads its body itself (after the key): the document
        still shows the body's schema."""

        def __post_init__(self) -> None:
            self.request_body = request_body(struct)
            ok = (self.responses or {}).get("200")
            if isinstance(ok, OpenAPIResponse) and ok.content is not None:
                ok.content["text/event-stream"] = OpenAPIMediaType(schema=STREAM)

    return _Documented


async def _answer_asgi(request: Request[Any, Any, Any], chat: bool) -> Response[Any]:
    on_disconnect: OnDisconnect | None = request.scope.get(ON_DISCONNECT)  # type: ignore[assignment]
    status, headers, payload = await answer_openai(
        request.app.state.inference,
        chat,
        str(request.scope.get(REQUEST_ID, "")),
        list(request.scope["headers"]),
        await request.body(),
        on_disconnect,
    )
    return _raw(status, headers, payload)


@post(
    COMPLETIONS_PATH,
    status_code=200,
    responses=_ERRORS,
    summary="OpenAI-compatible completion: each prompt is one request",
    description="stream: true answers as Server-Sent Events (text/event-stream), then "
    "data: [DONE].",
    security=[{"bearer": []}],
    operation_class=_operation(CompletionRequest),
    tags=["OpenAI-compatible"],
)
async def post_completions(request: Request[Any, Any, Any]) -> Response[Completion]:
    return await _answer_asgi(request, chat=False)


@post(
    CHAT_PATH,
    status_code=200,
    responses=_ERRORS,
    summary="OpenAI-compatible chat completion: the conversation rendered as one input",
    description="The policy's openai.chat_template renders the messages (default: the last "
    "user message's content). stream: true answers as Server-Sent Events.",
    security=[{"bearer": []}],
    operation_class=_operation(ChatRequest),
    tags=["OpenAI-compatible"],
)
async def post_chat(request: Request[Any, Any, Any]) -> Response[ChatCompletion]:
    return await _answer_asgi(request, chat=True)


@get(
    "/v1/models/{model_id:str}",
    summary="One model this key may use",
    responses={
        401: error_spec("UNAUTHENTICATED: no or unknown API key"),
        404: ResponseSpec(
            data_container=OpenAIError, description="model_not_found", generate_examples=False
        ),
    },
    security=[{"bearer": []}],
    tags=["OpenAI-compatible"],
)
async def get_model(request: Request[Any, Any, Any], model_id: str) -> Response[ModelCard]:
    gw: Gateway = request.app.state.gateway
    policy = gw.policy.current
    key = gw.authenticate(authorization_of(request), policy)
    if model_id not in policy.models or not policy.may_use(key, model_id):
        error = ApiError(
            "MODEL_NOT_FOUND", f"no model {model_id[:80]!r} this key may use", param="model"
        )
        return _raw(*render_openai(error, str(request.scope.get(REQUEST_ID, "")), None))
    return Response(model_card(gw, model_id))


def model_card(gw: Gateway, name: str) -> ModelCard:
    return ModelCard(name, created=gw.started_ms // 1000)
