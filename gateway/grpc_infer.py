"""The gRPC API's one call, ``Infer``, down the same request path as POST
/v1/inference: keys, quotas, tiers, fair share, collapsing, the cache,
metrics and traces are HTTP's. The key is the ``authorization`` metadata;
the call's deadline shortens the request's; a call its client cancels (or
whose deadline passes) is withdrawn from the queue as a closed HTTP
connection is; a refusal is its one status code, said in the trailers as
HTTP says it in headers."""

import asyncio
from collections.abc import Callable
from typing import Any, TypeAlias

import grpc
import msgspec
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from infergate.base import logs
from infergate.base.grpc_api import inference_pb2
from infergate.gateway.api import InferenceRequest, InferenceResponse
from infergate.gateway.auth import SEVERAL_AUTHORIZATIONS
from infergate.gateway.calls import Call
from infergate.gateway.errors import ApiError
from infergate.gateway.inference import Inference
from infergate.gateway.middleware import new_request_id

log = logs.get(__name__)

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
# An HTTP status, as the one gRPC code it is.
STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# The request's deadline is a little shorter than the call's: its answer
# has to reach the client before the call's own end.
DEADLINE_MARGIN_MS = 20
# The longest a request may wait (InferenceRequest's timeout_ms bound): a
# longer deadline leaves the tier's deadline in force.
MOST_TIMEOUT_MS = 600_000
RETRY_TOO_MANY_CALLS_MS = 100


def parse(data: bytes) -> inference_pb2.InferRequest | str:
    """The call's message, or why it is not one (a message gRPC cannot
    read would otherwise be UNKNOWN, with a traceback in the log)."""
    try:
        message: inference_pb2.InferRequest = inference_pb2.InferRequest.FromString(data)
    except DecodeError as exc:
        return f"the message is not an infergate.v1.InferRequest: {exc}"
    return message


def _unknown_field(message: inference_pb2.InferRequest) -> int | None:
    """A field number this API does not have, if one came (refused, as HTTP
    refuses an unknown field: a newer client's ask never silently ignored)."""
    for part in (message, message.parameters):
        for field in UnknownFieldSet(part):
            return int(field.field_number)
    return None


def body_of(
    message: inference_pb2.InferRequest | str, remaining_s: float | None
) -> InferenceRequest:
    """The request as POST /v1/inference's body, checked the same way; the
    call's deadline (``remaining_s``) shortens its timeout."""
    if isinstance(message, str):
        raise ApiError("INVALID_INPUT", message)
    unknown = _unknown_field(message)
    if unknown is not None:
        raise ApiError("INVALID_INPUT", f"field number {unknown} is not in this API")
    fields: dict[str, Any] = {"input": message.input}
    if message.HasField("timeout_ms"):
        fields["timeout_ms"] = message.timeout_ms
    if message.HasField("model"):
        fields["model"] = message.model
    if message.HasField("parameters"):
        params = message.parameters
        fields["parameters"] = {
            name: getattr(params, name)
            for name in ("max_tokens", "temperature")
            if params.HasField(name)
        }
    if remaining_s is not None:
        left_ms = min(int(remaining_s * 1000) - DEADLINE_MARGIN_MS, MOST_TIMEOUT_MS)
        if left_ms < 1:
            raise ApiError("TIMEOUT", "the call's deadline leaves no time to serve it")
        fields["timeout_ms"] = min(fields.get("timeout_ms", left_ms), left_ms)
    try:
        return msgspec.convert(fields, InferenceRequest)
    except msgspec.ValidationError as exc:
        raise ApiError("INVALID_INPUT", f"invalid request: {exc}") from None


def response_of(answer: InferenceResponse) -> inference_pb2.InferResponse:
    meta = answer.metadata
    return inference_pb2.InferResponse(
        request_id=answer.request_id,
        output=answer.output,
        latency_ms=answer.latency_ms,
        tier=answer.tier,
        batch_size=answer.batch_size,
        queue_ms=answer.queue_ms,
        served_by=answer.served_by,
        model=answer.model or "",
        tokens_used=meta.tokens_used if meta is not None else 0,
        model_version=meta.model_version if meta is not None else "",
    )


Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


def _metadata(context: Context) -> tuple[str | None, str | None, str | None]:
    """The call's authorization (several are one refused credential), traceparent, tracestate."""
    authorization = traceparent = tracestate = None
    for name, value in context.invocation_metadata() or ():
        if not isinstance(value, str):
            continue  # (a binary header: none of these)
        if name == "authorization":
            authorization = value if authorization is None else SEVERAL_AUTHORIZATIONS
        elif name == "traceparent":
            traceparent = value
        elif name == "tracestate":
            tracestate = value
    return authorization, traceparent, tracestate


class _Withdrawal:
    """The hook a request registers to be withdrawn when its client goes
    (``calls.OnDisconnect``): run when the call is cancelled, or at once if
    it registers after that (its client left while it was being admitted),
    as the HTTP edge does for a connection already lost."""

    def __init__(self) -> None:
        self._callback: Callable[[], None] | None = None
        self._gone = False

    def hook(self, callback: Callable[[], None] | None) -> None:
        if callback is not None and self._gone:
            asyncio.get_running_loop().call_soon(callback)
            return
        self._callback = callback

    def client_gone(self) -> None:
        self._gone = True
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


class InferenceService:
    """``Infer``, with at most ``max_calls`` at once in this process (the
    HTTP edge's --max-connections): one more is refused at once."""

    def __init__(self, inference: Inference, max_calls: int) -> None:
        self.inference = inference
        self.max_calls = max_calls
        self.calls = 0

    def handler(self) -> grpc.GenericRpcHandler:
        """``Infer`` with a parser that never raises (``parse``)."""
        infer = grpc.unary_unary_rpc_method_handler(
            self.Infer,
            request_deserializer=parse,
            response_serializer=inference_pb2.InferResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Infer": infer})

    async def Infer(
        self, request: inference_pb2.InferRequest | str, context: Context
    ) -> inference_pb2.InferResponse:
        request_id = new_request_id()
        self.calls += 1
        try:
            answer, headers = await self._serve(request, context, request_id)
        except ApiError as exc:
            await _abort(context, exc, request_id)
            raise AssertionError("unreachable") from None  # (abort raises)
        except Exception as exc:  # a bug here: said as HTTP says it, logged with its stack
            log.exception("grpc.unexpected_error", request_id=request_id, error=type(exc).__name__)
            await _abort(context, ApiError("INTERNAL", "internal error"), request_id)
            raise AssertionError("unreachable") from None
        finally:
            self.calls -= 1
        context.set_trailing_metadata([("x-request-id", request_id), *headers.items()])
        return response_of(answer)

    async def _serve(
        self, request: inference_pb2.InferRequest | str, context: Context, request_id: str
    ) -> tuple[InferenceResponse, dict[str, str]]:
        authorization, traceparent, tracestate = _metadata(context)
        try:
            body = self._admissible(request, context)
        except ApiError as refused:
            raise self._key_first(authorization, refused) from None
        withdrawal = _Withdrawal()
        call = Call(
            request_id, authorization, b"", withdrawal.hook, traceparent, tracestate, request=body
        )
        # Shielded: a cancelled call withdraws its request (the hook) and the
        # request path ends by itself, as with a closed connection.
        running = asyncio.ensure_future(self.inference.infer(call))
        running.add_done_callback(_consumed)
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            withdrawal.client_gone()
            raise

    def _admissible(
        self, request: inference_pb2.InferRequest | str, context: Context
    ) -> InferenceRequest:
        if self.calls > self.max_calls:
            raise ApiError(
                "SERVICE_OVERLOADED",
                f"this gateway has {self.max_calls} gRPC calls open; retry",
                RETRY_TOO_MANY_CALLS_MS,
            )
        return body_of(request, context.time_remaining())

    def _key_first(self, authorization: str | None, refused: ApiError) -> ApiError:
        """A call refused before the request path: its key's refusal first,
        as HTTP checks the key before the body; counted as HTTP counts it."""
        gw = self.inference.gw
        try:
            refused.tier = gw.authenticate(authorization, gw.policy.current).tier
        except ApiError as denied:
            refused = denied
        self.inference.count_refused(refused)
        return refused


def _consumed(task: "asyncio.Future[Any]") -> None:
    """A request path whose call was cancelled: its outcome is nobody's (a
    bug's is still logged)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ApiError):
        log.error("grpc.orphan_failed", error=type(exc).__name__, detail=str(exc)[:200])


async def _abort(context: Context, exc: ApiError, request_id: str) -> None:
    """The error as its status code, with what the HTTP answer's headers
    say in the trailing metadata: its code, its request id, when to retry
    (``grpc-retry-pushback-ms``: a gRPC client's retry policy reads it)."""
    trailers = [("x-request-id", request_id), ("x-error-code", exc.code)]
    trailers += [(k.lower(), v) for k, v in exc.headers.items()]
    if exc.retry_after_ms is not None:
        trailers.append(("retry-after-ms", str(exc.retry_after_ms)))
        trailers.append(("grpc-retry-pushback-ms", str(exc.retry_after_ms)))
    code = STATUS.get(exc.status, grpc.StatusCode.UNKNOWN)
    await context.abort(code, exc.message, trailing_metadata=tuple(trailers))
