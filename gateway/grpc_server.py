"""The gRPC API beside HTTP (``--grpc-port``, off by default): ``Infer`` over
the same request path as POST /v1/inference, so keys, quotas, tiers, fair
share, collapsing, the cache, metrics and traces are the same. The key is
the ``authorization`` metadata; the call's deadline shortens the request's;
a call its client cancels (or whose deadline passes) is withdrawn from the
queue as a closed HTTP connection is; an error is its one status code.
Bounded like the HTTP edge: message size, streams a connection, calls at
once, metadata size, idle connections."""

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import msgspec
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from infergate.base import logs
from infergate.base.grpc_api import inference_pb2
from infergate.base.loops import Supervised
from infergate.gateway.api import InferenceRequest, InferenceResponse
from infergate.gateway.auth import SEVERAL_AUTHORIZATIONS
from infergate.gateway.calls import Call
from infergate.gateway.errors import ApiError
from infergate.gateway.inference import Inference
from infergate.gateway.limits import EdgeLimits
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
# Streams one connection may have open at once.
MAX_STREAMS = 100
# The metadata of one call (the HTTP edge's --max-head-bytes).
MAX_METADATA_BYTES = 16_384
# The deadline the request gets is a little shorter than the call's: its
# answer has to reach the client before the call's own end.
DEADLINE_MARGIN_MS = 20


class BadCall(ValueError):
    """The message does not fit the API; the text says why."""


def parse(data: bytes) -> inference_pb2.InferRequest | str:
    """The call's message, or why it is not one (a message gRPC cannot
    read would otherwise be UNKNOWN, with a traceback in the log)."""
    try:
        message: inference_pb2.InferRequest = inference_pb2.InferRequest.FromString(data)
        return message
    except DecodeError as exc:
        return f"the message is not an infergate.v1.InferRequest: {exc}"


def _unknown_fields(message: inference_pb2.InferRequest) -> list[int]:
    """Field numbers this API does not have (refused, as HTTP refuses an
    unknown field: never a newer client's ask silently ignored)."""
    found = [f.field_number for f in UnknownFieldSet(message)]
    if message.HasField("parameters"):
        found += [f.field_number for f in UnknownFieldSet(message.parameters)]
    return found


def body_of(
    message: inference_pb2.InferRequest | str, remaining_s: float | None
) -> InferenceRequest:
    """The request as POST /v1/inference's body, checked the same way; the
    call's deadline (``remaining_s``) shortens its timeout."""
    if isinstance(message, str):
        raise ApiError("INVALID_INPUT", message)
    unknown = _unknown_fields(message)
    if unknown:
        raise ApiError("INVALID_INPUT", f"unknown field number(s) {unknown}: not in this API")
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
        left_ms = int(remaining_s * 1000) - DEADLINE_MARGIN_MS
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


def _metadata(
    context: grpc.aio.ServicerContext[Any, Any],
) -> tuple[str | None, str | None, str | None]:
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
    (``calls.OnDisconnect``): run when the call is cancelled."""

    def __init__(self) -> None:
        self._callback: Callable[[], None] | None = None

    def hook(self, callback: Callable[[], None] | None) -> None:
        self._callback = callback

    def client_gone(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


class InferenceService:
    def __init__(self, inference: Inference) -> None:
        self.inference = inference

    def handler(self) -> grpc.GenericRpcHandler:
        """``Infer`` with a parser that never raises (``parse``)."""
        infer = grpc.unary_unary_rpc_method_handler(
            self.Infer,
            request_deserializer=parse,
            response_serializer=inference_pb2.InferResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Infer": infer})

    async def Infer(
        self,
        request: inference_pb2.InferRequest | str,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> inference_pb2.InferResponse:
        request_id = new_request_id()
        try:
            answer, headers = await self._serve(request, context, request_id)
        except ApiError as exc:
            await _abort(context, exc, request_id)
            raise AssertionError("unreachable") from None  # (abort raises)
        except Exception as exc:  # a bug here: said as HTTP says it, logged with its stack
            log.exception("grpc.unexpected_error", request_id=request_id, error=type(exc).__name__)
            await _abort(context, ApiError("INTERNAL", "internal error"), request_id)
            raise AssertionError("unreachable") from None
        context.set_trailing_metadata(_trailers(headers, request_id))
        return response_of(answer)

    async def _serve(
        self,
        request: inference_pb2.InferRequest | str,
        context: grpc.aio.ServicerContext[Any, Any],
        request_id: str,
    ) -> tuple[InferenceResponse, dict[str, str]]:
        authorization, traceparent, tracestate = _metadata(context)
        try:
            body = body_of(request, context.time_remaining())
        except ApiError:
            gw = self.inference.gw
            try:  # (the key first, as HTTP checks it before the body)
                gw.authenticate(authorization, gw.policy.current)
            except ApiError as denied:
                exc = denied
            self.inference.count_refused(exc)
            raise exc from None
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


def _consumed(task: "asyncio.Future[Any]") -> None:
    """A request path whose call was cancelled: its outcome is nobody's."""
    if not task.cancelled():
        task.exception()


def _trailers(headers: dict[str, str], request_id: str) -> list[tuple[str, str]]:
    return [("x-request-id", request_id), *headers.items()]


async def _abort(
    context: grpc.aio.ServicerContext[Any, Any], exc: ApiError, request_id: str
) -> None:
    """The error as its status code, with what the HTTP answer's headers
    say in the trailing metadata: its code, its request id, when to retry
    (``grpc-retry-pushback-ms``: a gRPC client's retry policy reads it)."""
    if exc.status >= 500 and exc.code not in ("SERVICE_OVERLOADED", "TIMEOUT"):
        log.warning("grpc.failed", code=exc.code, request_id=request_id)
    trailers = [("x-request-id", request_id), ("x-error-code", exc.code)]
    trailers += [(k.lower(), v) for k, v in exc.headers.items()]
    if exc.retry_after_ms is not None:
        trailers.append(("retry-after-ms", str(exc.retry_after_ms)))
        trailers.append(("grpc-retry-pushback-ms", str(exc.retry_after_ms)))
    code = STATUS.get(exc.status, grpc.StatusCode.UNKNOWN)
    await context.abort(code, exc.message, trailing_metadata=tuple(trailers))


def server_options(limits: EdgeLimits, max_message_bytes: int) -> Sequence[tuple[str, int]]:
    return (
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_concurrent_streams", MAX_STREAMS),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.max_connection_idle_ms", max(1000, round(limits.keep_alive_s * 1000))),
        # A client's pings: no more often than every 10 s with nothing sent.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 1),
    )


class GrpcServer:
    """The gRPC port of one gateway process, with the health service (the
    gateway's readiness, read once a second) and reflection."""

    def __init__(
        self,
        inference: Inference,
        host: str,
        port: int,
        limits: EdgeLimits,
        max_message_bytes: int,
    ) -> None:
        self.server = grpc.aio.server(
            options=server_options(limits, max_message_bytes),
            maximum_concurrent_rpcs=limits.max_connections,
        )
        self.server.add_generic_rpc_handlers((InferenceService(inference).handler(),))
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._ready = inference.gw.ready
        self._health_loop = Supervised("grpc-health", self._set_health, 1.0)

    async def start(self) -> None:
        """Listen (raises OSError where the port cannot be had)."""
        try:
            bound = self.server.add_insecure_port(self.address)
        except RuntimeError as exc:  # (grpc's word for a port it cannot bind)
            raise OSError(f"cannot listen on {self.address}: {exc}") from None
        if bound == 0:
            raise OSError(f"cannot listen on {self.address}")
        await self.server.start()
        self._health_loop.start()
        log.info("grpc.started", address=self.address)

    async def _set_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if self._ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE):
            await self.health.set(service, status)

    async def stop(self, grace_s: float) -> None:
        await self._health_loop.stop()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
