"""What the HTTP edge relies on in uvicorn beyond its public API, checked
when a gateway starts: a uvicorn that renamed one of these, or whose
protocol no longer drives the edge's requests, makes the gateway refuse to
start, saying why, instead of answering 400 to every request
(pyproject.toml bounds uvicorn to the versions tested;
tests/test_internals.py drives the edge the same way). And uvicorn's own
warnings for requests the edge answers and logs itself (rate-limited)."""

import asyncio
import logging
from typing import Any

import uvicorn
from infergate.gateway.edge import EdgeProtocol
from infergate.gateway.errors import Headers
from infergate.gateway.fast_route import FastRoute
from infergate.gateway.limits import EdgeLimits
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

# What the edge uses of uvicorn's httptools protocol beyond its public
# constructor: checked when a gateway starts (``missing_internals``), so a
# uvicorn that renamed one refuses to start instead of answering 400 to all.
PROTOCOL_METHODS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "send_400_response",
    "_start_asgi_task",
)
# Set on each connection by uvicorn once it has read a request.
PROTOCOL_ATTRIBUTES = (
    "cycle",
    "flow",
    "pipeline",
    "parser",
    "server_state",
    "connections",
    "loop",
    "transport",
    "headers",
    "url",
    "scope",
    "expect_100_continue",
)


def missing_internals(protocol: object | None = None) -> list[str]:
    """The uvicorn internals the edge uses that are not there: its methods on
    the class and, given a protocol that has read a request, the attributes
    on it."""
    missing = [
        f"HttpToolsProtocol.{name}"
        for name in PROTOCOL_METHODS
        if not callable(getattr(HttpToolsProtocol, name, None))
    ]
    if protocol is not None:
        missing += [
            f"HttpToolsProtocol().{name}"
            for name in PROTOCOL_ATTRIBUTES
            if not hasattr(protocol, name)
        ]
    return missing


# What uvicorn logs for each such request, at a client's will (the last,
# for an upgrade, when no websocket protocol is configured: none is).
_PER_REQUEST_WARNINGS = frozenset(
    {"Invalid HTTP request received.", "Unsupported upgrade request."}
)
_PER_REQUEST_PREFIXES = ("No supported WebSocket library detected",)


class MemoryTransport(asyncio.Transport):
    """What uvicorn's protocol asks of a socket transport, kept in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.wrote = asyncio.Event()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data
        self.wrote.set()

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    async def wait_for(self, marker: bytes, timeout_s: float = 2.0) -> bytes:
        """What was written, once ``marker`` is in it."""
        async with asyncio.timeout(timeout_s):
            while marker not in self.written:
                self.wrote.clear()
                await self.wrote.wait()
        return bytes(self.written)


async def _asgi_ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"asgi"})


def connect(route: FastRoute) -> tuple[EdgeProtocol, MemoryTransport]:
    """An edge connection as uvicorn's server makes one, on a transport in
    memory (no sweep timer of its own)."""
    config = uvicorn.Config(_asgi_ok, http="httptools", ws="none", lifespan="off", log_config=None)
    config.load()
    protocol_class = EdgeProtocol.with_limits(EdgeLimits(), route)
    protocol_class.sweeping = False
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = MemoryTransport()
    protocol.connection_made(transport)
    return protocol, transport


SELF_TEST = (
    b"POST /self-test HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\n\r\nping"
    b"GET /other HTTP/1.1\r\nhost: t\r\n\r\n"
)


async def self_test() -> str | None:
    """Two pipelined requests over one connection in memory, through the
    edge as the gateway runs it: one down a fast route, one through ASGI.
    Returns what went wrong (None: both answered 200, in order)."""
    faults: list[str] = []

    async def answer(
        request_id: str, headers: Headers, body: bytes, on_disconnect: Any
    ) -> tuple[int, Headers, bytes]:
        return 200, [], b"fast:" + body

    route = FastRoute(
        b"POST", b"/self-test", answer, lambda: 64, lambda status: None, faults.append
    )
    try:
        missing = missing_internals()
        if missing:
            return "missing: " + ", ".join(missing)
        protocol, transport = connect(route)
        protocol.data_received(SELF_TEST)
        written = await transport.wait_for(b"asgi")
        protocol.connection_lost(None)
    except Exception as exc:  # (what moved is in its description)
        return faults[0] if faults else f"{type(exc).__name__}: {exc}"
    if faults:
        return faults[0]
    if written.count(b"HTTP/1.1 200 OK") != 2 or written.index(b"fast:ping") > written.index(
        b"asgi"
    ):
        return f"unexpected answers: {written[:300]!r}"
    return None


class _WithoutParserWarnings(logging.Filter):
    """uvicorn logs a warning for every request its parser rejects, before
    the edge answers it, and for every upgrade it does not serve; the edge's
    own line (``edge.refused``) is rate-limited, so uvicorn's are dropped: a
    hostile client cannot flood the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return message not in _PER_REQUEST_WARNINGS and not message.startswith(
            _PER_REQUEST_PREFIXES
        )


def quiet_parser_warnings() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _WithoutParserWarnings) for f in logger.filters):
        logger.addFilter(_WithoutParserWarnings())
