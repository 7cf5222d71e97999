"""The gRPC port of a gateway (``--grpc-port``, off by default): ``Infer``
(``grpc_infer.py``), the standard health service and reflection. Bounded
like the HTTP edge: message size, streams a connection, calls at once,
metadata, idle connections, pings. The health service answers ``Check``
from the gateway's readiness when asked (``Watch``, a stream held open,
is not served: it would hold a slot for ever), and reflection streams are
few at once."""

from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer
from infergate.base import logs
from infergate.gateway.grpc_infer import SERVICE, Context, InferenceService
from infergate.gateway.inference import Inference
from infergate.gateway.limits import EdgeLimits

log = logs.get(__name__)

# Streams one connection may have open at once: a client multiplexes its
# calls on one connection (1,000 req/s at 200 ms is 200 open), and past it
# a call is refused unread (RST_STREAM), which a client may not retry; the
# process's cap on calls (--max-connections) answers with a pushback instead.
MAX_STREAMS = 1_000
# The metadata of one call (the HTTP edge's --max-head-bytes).
MAX_METADATA_BYTES = 16_384
# Reflection streams open at once in a process (a tool's, for a moment).
MAX_REFLECTION_STREAMS = 16
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def server_options(limits: EdgeLimits, max_message_bytes: int) -> Sequence[tuple[str, int]]:
    return (
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_concurrent_streams", MAX_STREAMS),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.max_connection_idle_ms", max(1000, round(limits.keep_alive_s * 1000))),
        # A client's pings: no more often than every 10 s with nothing sent.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 1),
    )


class Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """``grpc.health.v1.Health``: SERVING while the gateway is ready, for
    the whole server ("") and for ``infergate.v1.Inference``."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", SERVICE):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service[:200]!r}")
        ready = self._ready()
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served: call Check")


class FewReflections(ReflectionServicer):  # type: ignore[misc]
    """Reflection, with at most ``MAX_REFLECTION_STREAMS`` streams at once."""

    open = 0

    async def ServerReflectionInfo(
        self,
        request_iterator: AsyncIterator[reflection_pb2.ServerReflectionRequest],
        context: Context,
    ) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        if FewReflections.open >= MAX_REFLECTION_STREAMS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many reflection streams")
        FewReflections.open += 1
        try:
            async for reply in super().ServerReflectionInfo(request_iterator, context):
                yield reply
        finally:
            FewReflections.open -= 1


class GrpcServer:
    """The gRPC port of one gateway process."""

    def __init__(
        self,
        inference: Inference,
        host: str,
        port: int,
        limits: EdgeLimits,
        max_message_bytes: int,
    ) -> None:
        self.server = grpc.aio.server(options=server_options(limits, max_message_bytes))
        infer = InferenceService(inference, limits.max_connections)
        self.server.add_generic_rpc_handlers((infer.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(Health(inference.gw.ready), self.server)
        names = (SERVICE, HEALTH, reflection.SERVICE_NAME)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            FewReflections(names), self.server
        )
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def start(self) -> None:
        """Listen (raises OSError where the port cannot be had)."""
        try:
            bound = self.server.add_insecure_port(self.address)
        except RuntimeError as exc:  # (grpc's word for a port it cannot bind)
            raise OSError(f"cannot listen on {self.address}: {exc}") from None
        if bound == 0:
            raise OSError(f"cannot listen on {self.address}")
        await self.server.start()
        log.info("grpc.started", address=self.address)

    async def stop(self, grace_s: float) -> None:
        """Take no more calls; those open get ``grace_s`` to end."""
        await self.server.stop(grace_s)
