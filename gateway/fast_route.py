"""The edge's fast route: a request the edge serves itself, without ASGI
(``FastRoute``: POST /v1/inference), as one ``FastCycle`` that uvicorn's
protocol drives like its own request cycles (body, disconnect, pipelining,
keep-alive, graceful shutdown), its answer written in one piece; and the
response bytes the edge writes itself (``error_response``)."""

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from infergate.base import logs
from infergate.gateway.errors import ApiError, Headers, render
from infergate.gateway.limits import Body
from infergate.gateway.middleware import new_request_id
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

log = logs.get(__name__)


def error_response(
    error: ApiError, request_id: str, default_headers: Sequence[tuple[bytes, bytes]] = ()
) -> bytes:
    """A complete HTTP/1.1 response in the one error shape, closing the
    connection (after the server's own headers, date and server, if given)."""
    status, headers, body = render(error, request_id)
    return response_bytes(
        status,
        [
            *default_headers,
            *headers,
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
            (b"x-request-id", request_id.encode()),
        ],
        body,
    )


def response_bytes(status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> bytes:
    out = [STATUS_LINE[status]]
    for name, value in headers:
        out += (name, b": ", value, b"\r\n")
    out += (b"\r\n", body)
    return b"".join(out)


# Registers the callback to run if the connection is lost (None clears it).
DisconnectHook = Callable[[Callable[[], None] | None], None]


@dataclass(frozen=True)
class FastRoute:
    """A route the edge serves itself, from the request's head and body."""

    method: bytes
    path: bytes
    # (request id, headers, body, disconnect hook) -> (status, headers, body);
    # it never raises: every failure is an answer in the one error shape.
    answer: Callable[[str, Headers, bytes, DisconnectHook], Awaitable[tuple[int, Headers, bytes]]]
    max_body_bytes: Callable[[], int]  # read per request: the live policy's
    on_refused: Callable[[int], None]  # a status the edge answered itself (413)
    # The edge failed to read a request through its own fault (the cause's
    # description): the gateway counts it.
    on_fault: Callable[[str], None] = lambda cause: None


class Connection(Protocol):
    """What a fast cycle uses of its connection (``edge.EdgeProtocol``)."""

    transport: asyncio.Transport
    flow: Any  # uvicorn's FlowControl
    server_state: Any  # uvicorn's ServerState
    headers: "Headers"
    expect_100_continue: bool
    _lost: bool

    def _watch_disconnect(self, callback: Callable[[], None] | None) -> None: ...

    def on_response_complete(self) -> None: ...


class _Wakeup:
    """The one wait of a fast cycle for more of its body (or a disconnect)."""

    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class FastCycle:
    """One request of a fast route. It has what uvicorn's protocol reads and
    sets on a request cycle (``message_event``, ``disconnected``,
    ``response_complete``, ``keep_alive``, ``run_asgi``), so uvicorn starts,
    queues (pipelining) and ends it like its own; the body is kept up to the
    route's limit, the answer is written in one piece."""

    def __init__(self, protocol: "Connection", route: FastRoute, keep_alive: bool) -> None:
        self.protocol = protocol
        self.route = route
        self.keep_alive = keep_alive
        self.headers = protocol.headers  # this request's (the next one gets a new list)
        self.expect_100 = protocol.expect_100_continue
        self.body = Body(route.max_body_bytes(), self.headers)
        self.more_body = True
        self.disconnected = False
        self.response_complete = False
        self.message_event = _Wakeup()

    # -- the protocol's side ---------------------------------------------------

    def add(self, chunk: bytes) -> None:
        self.body.add(chunk)
        self.message_event.set()

    def complete(self) -> None:
        self.more_body = False
        self.message_event.set()

    # -- the request -------------------------------------------------------------

    async def run_asgi(self, app: object) -> None:  # the name uvicorn calls
        try:
            await self._serve()
        except Exception as exc:  # a bug here: never a hung connection
            log.exception("edge.fast_route_failed", error=type(exc).__name__)
            self.protocol.transport.close()

    async def _serve(self) -> None:
        protocol, route = self.protocol, self.route
        request_id = new_request_id()
        body = self.body
        while self.more_body and not body.too_large and not self.disconnected:
            if self.expect_100:
                self.expect_100 = False
                protocol.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await self.message_event.wait()
        if self.disconnected:
            return
        if body.too_large:
            self._refuse_too_large(request_id)
            return
        status, headers, payload = await route.answer(
            request_id, self.headers, body.whole(), protocol._watch_disconnect
        )
        if protocol.flow.write_paused and not self._gone():
            await protocol.flow.drain()
        if self._gone():
            return
        protocol.transport.write(self._response(status, headers, payload))
        self._finish()

    def _gone(self) -> bool:
        """The client left (uvicorn marks only the connection's latest cycle:
        with pipelining, that may be a later request than this one)."""
        protocol = self.protocol
        return self.disconnected or protocol._lost or protocol.transport.is_closing()

    def _response(self, status: int, headers: Headers, payload: bytes) -> bytes:
        out = [*self.protocol.server_state.default_headers, *headers]
        out.append((b"content-length", b"%d" % len(payload)))
        if not self.keep_alive:
            out.append((b"connection", b"close"))
        return response_bytes(status, out, payload)

    def _refuse_too_large(self, request_id: str) -> None:
        logs.limited(log, "request.refused", status=413, code="PAYLOAD_TOO_LARGE")
        self.route.on_refused(413)
        error = self.body.error()
        self.keep_alive = False
        if not self._gone():
            default = self.protocol.server_state.default_headers
            self.protocol.transport.write(error_response(error, request_id, default))
        self._finish()

    def _finish(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.protocol.transport.close()
        self.protocol.on_response_complete()
