"""The HTTP edge: limits on what a client can make a gateway hold, enforced
where the bytes arrive (uvicorn's httptools protocol, extended).

uvicorn with httptools has no limit on the size of a request head and no
timeout for a client that never finishes it: httptools buffers a header it
has not seen the end of, so one connection streaming an endless header grows
the process without bound, and connections that send nothing are held
forever. This protocol adds, per connection:

- the request head (request line and headers) at most ``max_head_bytes``,
  each header at most ``max_header_bytes``, at most ``max_headers`` of them:
  431, connection closed;
- the head received within ``head_timeout_s`` of the connection opening or
  of the request's first byte, and the body within ``body_timeout_s`` of the
  head: 408, connection closed (a connection that sent nothing is just
  closed);
- at most ``max_connections`` open connections per process: one more
  takes the place of the connection idle (or in its head) the longest, or
  is closed as soon as it is accepted if every one has a request in the app;
- no switch of protocol (``Connection: Upgrade``, ``CONNECT``): 400,
  connection closed. The parser would treat the body as the new protocol's
  bytes, where none of these limits reach;
- at most ``max_pipelined`` requests waiting behind the one being answered
  (one more: 429, answered after them, connection closed), and nothing more
  read while any waits or while the client leaves an answer unread (uvicorn
  reads on after each answer); an answer unread for ``send_timeout_s``
  closes the connection. One connection holds a few requests and one
  socket buffer of answers, whatever it sends.

The idle keep-alive time is uvicorn's ``timeout_keep_alive``; the body's
size limit, which follows the live policy, is in ``middleware.py`` (and in
``FastCycle`` for a fast route).

A fast route (``FastRoute``: POST /v1/inference and the OpenAI routes'
POSTs) is served from here,
without ASGI: its request becomes a ``FastCycle`` (``fast_route.py``),
which uvicorn's protocol drives as it drives its own request cycles, and
its response goes out in one write. Every other request, and one with a
query string, goes through ASGI. Each refusal is one info log
line (rate-limited), never a traceback, and costs O(limit) memory: what a
chunk of the socket can bring beyond the limit is never kept.
"""

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import httptools
from infergate.base import logs
from infergate.gateway.errors import ApiError
from infergate.gateway.fast_route import FastCycle, FastRoute, error_response
from infergate.gateway.limits import EdgeLimits
from infergate.gateway.middleware import ON_DISCONNECT, new_request_id
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logs.get(__name__)


# What a parser callback raises when an internal of uvicorn the edge relies
# on has moved (an attribute or method gone, a signature changed). A client
# has provoked one too (uvicorn fails on a target with no path, refused
# before it now): so it is counted and logged, never a readiness verdict.
INTERNAL_FAULTS = (AttributeError, NameError, TypeError, ImportError)

UPGRADE_REFUSED = (
    "this gateway does not switch protocols (Connection: Upgrade, or CONNECT): "
    "send the request as plain HTTP/1.1"
)
HTTP_1_1_ONLY = "this gateway speaks HTTP/1.1 (and 1.0): send the request as HTTP/1.1"

# Where a connection is in its request: the limits that apply.
_IDLE, _HEAD, _BODY, _APP = 0, 1, 2, 3


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above.

    Time limits cost no timer per request: each connection notes when it
    entered its head or body, and one sweep per process (``_Sweeper``,
    several times per timeout) refuses those that stayed too long.
    """

    limits = EdgeLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _HEAD
        self._since = 0.0
        self._refused = False
        self._head_bytes = 0
        self._unread_since: float | None = None  # when the client stopped reading answers
        self._answering: Any = None  # the request cycle the app is answering
        # What to run if the connection is lost while the app holds a request.
        self._on_lost: Callable[[], None] | None = None
        self._lost = False

    @classmethod
    def with_limits(cls, limits: EdgeLimits, *routes: FastRoute) -> type["EdgeProtocol"]:
        by_target = {(route.method, route.path): route for route in routes}
        return type(
            "EdgeProtocol", (cls,), {"limits": limits, "routes": by_target, "sweeper": None}
        )

    sweeper: "_Sweeper | None" = None
    sweeping = True  # (off for the start-up self-test's connection)
    # The fast routes, by method and path.
    routes: dict[tuple[bytes, bytes], FastRoute] = {}

    # -- connection --------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._since = self.loop.time()
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            logs.limited(log, "edge.too_many_connections", limit=self.limits.max_connections)
            transport.abort()
            return
        cls = type(self)
        if cls.sweeper is None and cls.sweeping:
            cls.sweeper = _Sweeper(self.loop, self.connections, self.limits)

    def _evict_one(self) -> bool:
        """At the cap, a new connection takes the place of the one that has
        waited longest without a request in progress (``_longest_idle``); a
        connection whose request the app holds is never closed."""
        oldest = _longest_idle(self.connections, self)
        if oldest is None or oldest.transport is None:
            return False
        logs.limited(log, "edge.connection_evicted", limit=self.limits.max_connections)
        oldest._refused = True
        oldest.transport.abort()  # (closed at once: nothing is owed to it)
        self.connections.discard(oldest)
        return True

    def data_received(self, data: bytes) -> None:
        if self._phase == _IDLE:  # the first bytes of the next request on this connection
            self._phase = _HEAD
            self._head_bytes = 0
            self._since = self.loop.time()
        if self._phase == _HEAD:
            self._head_bytes += len(data)
        super().data_received(data)
        # Still inside the head after this chunk, and past the limit: the
        # parser holds at most the limit plus one chunk.
        if self._phase == _HEAD and self._head_bytes > self.limits.max_head_bytes:
            self._refuse(431, f"the request head is over {self.limits.max_head_bytes} bytes")

    # -- parser callbacks ----------------------------------------------------

    def on_message_begin(self) -> None:
        if self._refused:
            return
        if len(self.pipeline) >= self.limits.max_pipelined:
            # (the rest of this chunk is parsed for nothing: no request of it is kept)
            self._refuse(
                429,
                f"more than {self.limits.max_pipelined} requests are waiting on this "
                "connection; read the answers before sending more",
            )
            return
        if self._phase != _HEAD:  # a pipelined request, already in this chunk
            self._phase = _HEAD
            self._head_bytes = 0
            self._since = self.loop.time()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        refusal = _head_refused(self.url, self.headers, self.parser, self.limits)
        if refusal is not None:
            self._refuse(*refusal)
            return
        self._phase = _BODY
        self._since = self.loop.time()
        route = self.routes.get((self.parser.get_method(), self.url)) if self.routes else None
        if route is not None:
            self._start_fast(route)
            return
        if not self.url.startswith(b"/") and not _names_a_path(self.url):
            # (uvicorn would fail on it inside this callback: raw_path None)
            self._refuse(400, "the request target has no path")
            return
        self.scope[ON_DISCONNECT] = self._watch_disconnect  # type: ignore[literal-required]
        super().on_headers_complete()

    def _start_fast(self, route: FastRoute) -> None:
        """A fast route's request: a cycle uvicorn's protocol can drive."""
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        existing, self.cycle = self.cycle, FastCycle(self, route, keep_alive)  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            self._start_asgi_task(self.cycle, None)
        else:  # a pipelined request waits for the one before it
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, None))  # type: ignore[arg-type]

    def _watch_disconnect(self, callback: Callable[[], None] | None) -> None:
        """The request's hook (``service.OnDisconnect``): one slot per
        connection, since a connection runs one request at a time. A
        connection already lost (the client left before its request began to
        wait) runs the callback at once."""
        if callback is not None and self._lost:
            self.loop.call_soon(callback)
            return
        self._on_lost = callback

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._answering = cycle
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        # uvicorn marks only the latest cycle gone; with pipelining the one
        # being answered is an earlier one, which would write to a closed
        # transport once its wait for the client to read ends.
        answering = self._answering
        if answering is not None and not getattr(answering, "response_complete", True):
            answering.disconnected = True
        lost, self._on_lost = self._on_lost, None
        super().connection_lost(exc)
        if lost is not None:
            lost()

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        if isinstance(self.cycle, FastCycle):
            self.cycle.add(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._phase = _APP  # the app has the whole request: no edge time limit
        if isinstance(self.cycle, FastCycle):
            self.cycle.complete()
        else:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        self._on_lost = None
        if self._phase == _APP:  # (a pipelined next request may already be in its head)
            self._phase = _IDLE  # uvicorn's keep-alive timeout applies until the next request
            self._since = self.loop.time()
        elif self._phase == _BODY:  # a pipelined request's body: its time starts as reading does
            self._since = self.loop.time()
        super().on_response_complete()
        # uvicorn reads on after every answer: not while requests wait their
        # turn, nor while the client leaves answers unread (resume_writing).
        if self.pipeline or self.flow.write_paused:
            self.flow.pause_reading()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._unread_since = self.loop.time()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unread_since = None
        if not self.pipeline and not self._refused and self.transport is not None:
            self.flow.resume_reading()

    # -- limits ----------------------------------------------------------------

    def overdue(self, now: float) -> None:
        """Called by the sweep: refuse a head or body that is taking too long,
        and drop a connection whose client leaves its answers unread."""
        if (
            self._unread_since is not None
            and now - self._unread_since > self.limits.send_timeout_s
            and self.transport is not None
        ):
            logs.limited(log, "edge.unread_connection_closed")
            self._refused = True
            self.transport.abort()  # (close would wait for the client to read)
            return
        if self._refused or self.transport is None or self.transport.is_closing():
            return
        if self._phase == _HEAD and now - self._since > self.limits.head_timeout_s:
            if self._head_bytes == 0:
                logs.limited(log, "edge.idle_connection_closed")
                self._refused = True
                self.transport.close()
                return
            self._refuse(
                408, f"the request head did not arrive within {self.limits.head_timeout_s:g} s"
            )
        elif (
            self._phase == _BODY
            and not self.pipeline  # (a pipelined request waiting its turn cannot send)
            and now - self._since > self.limits.body_timeout_s
        ):
            self._refuse(
                408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s"
            )

    def _unsupported_upgrade_warning(self) -> None:
        """uvicorn's two lines per upgrade request it cannot serve: the edge
        has refused that request already, and said so (rate-limited)."""

    def send_400_response(self, msg: str) -> None:
        """What the HTTP parser cannot read (uvicorn answers it in plain
        text): 400 in the one error shape, connection closed. uvicorn calls
        this inside its ``except HttpParserError``; an exception a parser
        callback raised arrives chained to it. One that a moved internal
        raises (``INTERNAL_FAULTS``) is the edge's own fault, not the
        client's: logged with its cause and counted (an alert). Readiness
        does not follow it, so no request can take a gateway out of
        rotation; a broken edge never becomes ready (the start-up
        self-test, ``edge_contract.self_test``). Anything a client can
        provoke (an invalid URL) stays a client's 400."""
        error = sys.exc_info()[1]
        if isinstance(error, httptools.HttpParserCallbackError):
            cause = error.__cause__ or error.__context__
            if isinstance(cause, INTERNAL_FAULTS):
                described = f"{type(cause).__name__}: {cause}"
                logs.limited(log, "edge.fault", level="error", cause=described)
                route = next(iter(self.routes.values()), None)  # (each one's is the gateway's)
                if route is not None:
                    route.on_fault(described)
        self._refuse(400, "the request is not valid HTTP/1.1")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` in the one error shape and close the connection,
        after the requests pipelined before the refused one have their
        answers; nothing more is parsed from it."""
        if self._refused:
            return
        code = {400: "INVALID_INPUT", 408: "REQUEST_TIMEOUT", 429: "RATE_LIMITED"}.get(
            status, "HEADERS_TOO_LARGE"
        )
        logs.limited(log, "edge.refused", status=status, code=code)
        self._refused = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        default = self.server_state.default_headers
        refusal = error_response(ApiError(code, message), new_request_id(), default)
        self.parser = _Closed()  # type: ignore[assignment]
        # A refusal of a body refuses the request in the app's hands (the
        # connection's current cycle); any other, a request after it.
        behind = self._phase != _BODY
        if behind and self.cycle is not None and not self.cycle.response_complete:
            self.flow.pause_reading()
            self.pipeline.appendleft((_Refusal(self, refusal), None))  # type: ignore[arg-type]
            return
        transport.write(refusal)
        transport.close()


class _Refusal:
    """A refusal queued behind the requests in flight on its connection:
    run, as uvicorn runs a pipelined request, once they are answered."""

    def __init__(self, protocol: EdgeProtocol, response: bytes) -> None:
        self.protocol = protocol
        self.response = response

    async def run_asgi(self, app: object) -> None:  # the name uvicorn calls
        transport = self.protocol.transport
        if not transport.is_closing():
            transport.write(self.response)
            transport.close()


class _Sweeper:
    """One timer per process that checks every connection's time limits."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, connections: set[Any], limits: EdgeLimits
    ) -> None:
        self.loop = loop
        self.connections = connections
        timeouts_s = (limits.head_timeout_s, limits.body_timeout_s, limits.send_timeout_s)
        self.interval_s = max(0.05, min(1.0, *(t / 4 for t in timeouts_s)))
        self.loop.call_later(self.interval_s, self.sweep)

    def sweep(self) -> None:
        try:
            now = self.loop.time()
            for conn in list(self.connections):
                if isinstance(conn, EdgeProtocol):
                    try:
                        conn.overdue(now)
                    except Exception:  # one connection's trouble must not end the sweep
                        log.exception("edge.sweep_failed")
        finally:
            self.loop.call_later(self.interval_s, self.sweep)


def _longest_idle(connections: set[Any], newcomer: EdgeProtocol) -> EdgeProtocol | None:
    """The connection that has waited longest without a request in
    progress: kept alive idle, or still sending its head. A connection that
    costs its client nothing but a request every few seconds cannot hold
    the cap. (A scan of the connections: only at the cap.)"""
    oldest: EdgeProtocol | None = None
    for conn in connections:
        if (
            conn is not newcomer
            and isinstance(conn, EdgeProtocol)
            and conn._phase in (_IDLE, _HEAD)
            and not conn._refused
            and (conn.cycle is None or conn.cycle.response_complete)  # (none pipelined)
            and (oldest is None or conn._since < oldest._since)
        ):
            oldest = conn
    return oldest


def _head_refused(
    url: bytes, headers: list[tuple[bytes, bytes]], parser: Any, limits: EdgeLimits
) -> tuple[int, str] | None:
    """Why a request's head is refused, if it is (its status and message):
    too many headers, or too big (counted here, once, not per header: the
    head's byte limit already bounds what the parser holds before this; the
    whole head may have come in one chunk, past ``data_received``'s check),
    another HTTP version, a transfer coding the edge does not read, or a
    switch of protocol."""
    if len(headers) > limits.max_headers:
        return 431, f"more than {limits.max_headers} headers"
    head, largest, codings = len(url), 0, b""
    for name, value in headers:
        size = len(name) + len(value)
        head += size + 4
        if size > largest:
            largest = size
        if name == b"transfer-encoding":
            codings += b"," + value
    if head > limits.max_head_bytes:
        return 431, f"the request head is over {limits.max_head_bytes} bytes"
    if largest > limits.max_header_bytes:
        return 431, f"a header is over {limits.max_header_bytes} bytes"
    if parser.get_http_version() not in ("1.0", "1.1"):
        return 400, f"HTTP/{parser.get_http_version()}: {HTTP_1_1_ONLY}"
    other = _not_chunked(codings) if codings else ""
    if other:  # (its body would be read as chunked, whatever that coding made of it)
        why = "send the body as it is, chunked or with a Content-Length"
        return 400, f"the transfer coding {other!r} is not supported: {why}"
    if parser.should_upgrade():
        # HTTP/1.1 is all this gateway speaks: the parser would hand the
        # body to a protocol switch that never comes, outside every limit.
        return 400, UPGRADE_REFUSED
    return None


def _not_chunked(codings: bytes) -> str:
    """The first transfer coding of a request's that is not chunked ('' if
    none is): chunked is the only one the edge reads."""
    for coding in codings.split(b","):
        coding = coding.strip().lower()
        if coding and coding != b"chunked":
            return coding.decode("latin-1")
    return ""


def _names_a_path(url: bytes) -> bool:
    """An absolute-form target (``http://host/...``) has a path; one with
    none (``http://host``) is the client's 400 here. One httptools cannot
    parse at all is uvicorn's to refuse, as any invalid URL."""
    try:
        return httptools.parse_url(url).path is not None
    except httptools.HttpParserInvalidURLError:
        return True


class _Closed:
    """Stands in for the parser once a connection has been refused."""

    def feed_data(self, data: bytes) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)
