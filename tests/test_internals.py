"""The library internals the hot paths rely on, driven in milliseconds over
fake transports: a uvicorn or redis-py that moved one fails a test here that
names it, before the stack tests fail for reasons that say nothing of it.

The edge (``gateway/edge.py``) extends uvicorn's httptools protocol; the
RESP reader (``base/queue/resp.py``) reads a redis-py connection's streams.
pyproject.toml bounds both libraries to the versions tested here.
"""

import asyncio
import sys
from pathlib import Path
from typing import Any

import httptools
import pytest
from infergate.base.queue.resp import RawConnection, RedisInternalsMoved
from infergate.gateway import edge, edge_contract
from infergate.gateway.edge import EdgeProtocol
from infergate.gateway.edge_contract import MemoryTransport, connect, missing_internals, self_test
from infergate.gateway.errors import Headers
from infergate.gateway.fast_route import FastRoute
from infergate.gateway.limits import Body
from redis.asyncio.connection import Connection
from redis.exceptions import NoScriptError
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

INFERENCE = b'POST /v1/inference HTTP/1.1\r\nhost: t\r\ncontent-length: 16\r\n\r\n{"input":"ping"}'


def route(faults: list[str]) -> FastRoute:
    async def answer(
        request_id: str, headers: Headers, body: bytes, on_disconnect: Any
    ) -> tuple[int, Headers, bytes]:
        return 200, [(b"content-type", b"application/json")], b'{"echo":' + body + b"}"

    return FastRoute(
        b"POST", b"/v1/inference", answer, lambda: 1024, lambda status: None, faults.append
    )


async def wait_for_bytes(transport: MemoryTransport, marker: bytes) -> bytes:
    return await transport.wait_for(marker)


def test_the_installed_uvicorn_has_every_internal_the_edge_uses() -> None:
    assert missing_internals() == []


async def test_a_protocol_has_every_attribute_the_edge_uses() -> None:
    protocol, transport = connect(route([]))
    protocol.data_received(INFERENCE)
    await wait_for_bytes(transport, b"}}")
    assert missing_internals(protocol) == []


def test_an_internal_that_moved_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(HttpToolsProtocol, "_start_asgi_task")
    assert missing_internals() == ["HttpToolsProtocol._start_asgi_task"]


async def test_the_start_up_self_test_passes_on_the_installed_uvicorn() -> None:
    assert await self_test() is None


async def test_the_start_up_self_test_names_what_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway runs it before it listens, and refuses to start on an
    answer (tests/test_probes.py): a broken edge is never ready."""

    def moved(self: EdgeProtocol, route: FastRoute) -> None:
        raise AttributeError("'EdgeProtocol' object has no attribute '_start_asgi_task'")

    monkeypatch.setattr(EdgeProtocol, "_start_fast", moved)
    assert await self_test() == (
        "AttributeError: 'EdgeProtocol' object has no attribute '_start_asgi_task'"
    )
    monkeypatch.delattr(HttpToolsProtocol, "_start_asgi_task")
    assert await self_test() == "missing: HttpToolsProtocol._start_asgi_task"


async def test_the_fast_route_is_served_by_the_edge_itself() -> None:
    faults: list[str] = []
    protocol, transport = connect(route(faults))
    protocol.data_received(INFERENCE)
    written = await wait_for_bytes(transport, b"}}")
    assert written.startswith(b"HTTP/1.1 200 OK\r\n"), written
    assert written.endswith(b'\r\n\r\n{"echo":{"input":"ping"}}')
    assert faults == []
    assert not transport.closed  # keep-alive


async def test_other_requests_go_through_asgi() -> None:
    protocol, transport = connect(route([]))
    protocol.data_received(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
    written = await wait_for_bytes(transport, b"asgi")
    assert written.startswith(b"HTTP/1.1 200 OK\r\n"), written


async def test_pipelined_fast_requests_are_answered_in_order() -> None:
    protocol, transport = connect(route([]))
    protocol.data_received(INFERENCE + INFERENCE.replace(b"ping", b"pong"))
    written = await wait_for_bytes(transport, b"pong")
    assert written.index(b"ping") < written.index(b"pong")
    assert written.count(b"HTTP/1.1 200 OK") == 2


async def test_a_fault_of_the_edge_is_reported_with_its_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An internal that moved fails inside a parser callback: httptools turns
    that into a parser error, and the client sees 400 as for bad bytes. The
    edge tells the two apart and reports its own fault (the gateway counts
    it; it never reaches readiness: the self-test above)."""

    def moved(self: EdgeProtocol, route: FastRoute) -> None:
        raise AttributeError("'EdgeProtocol' object has no attribute '_start_asgi_task'")

    monkeypatch.setattr(EdgeProtocol, "_start_fast", moved)
    faults: list[str] = []
    protocol, transport = connect(route(faults))
    protocol.data_received(INFERENCE)
    written = await wait_for_bytes(transport, b"INVALID_INPUT")
    assert written.startswith(b"HTTP/1.1 400 ")
    assert faults == ["AttributeError: 'EdgeProtocol' object has no attribute '_start_asgi_task'"]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        # uvicorn parses the URL inside a parser callback: an invalid one
        # raises there, and must stay the client's 400, not a fault that
        # would take the gateway out of readiness.
        b"GET http://[::1 HTTP/1.1\r\nhost: t\r\n\r\n",
        b"POST http://a:99999999/v1/inference HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n",
        b"GET /\xff\xfe HTTP/1.1\r\nhost: t\r\n\r\n",
        # An absolute target with no path: uvicorn fails on it (raw_path
        # None, an AttributeError) unless the edge refuses it first.
        b"GET http://example.com HTTP/1.1\r\nhost: t\r\n\r\n",
        b"POST http://a:b@h?x=1 HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n",
    ],
)
async def test_a_clients_bad_bytes_are_not_a_fault(request_bytes: bytes) -> None:
    faults: list[str] = []
    protocol, transport = connect(route(faults))
    protocol.data_received(request_bytes)
    written = await wait_for_bytes(transport, b"INVALID_INPUT")
    assert written.startswith(b"HTTP/1.1 400 ")
    assert faults == []
    assert transport.closed


def test_httptools_reports_a_callback_failure_as_its_own_error() -> None:
    """What the edge's fault detection reads: a callback's exception comes
    out as HttpParserCallbackError, chained to the original."""

    class Callbacks:
        def on_headers_complete(self) -> None:
            raise KeyError("moved")

    parser = httptools.HttpRequestParser(Callbacks())
    with pytest.raises(httptools.HttpParserCallbackError) as raised:
        parser.feed_data(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
    cause = raised.value.__cause__ or raised.value.__context__
    assert isinstance(cause, KeyError)


def opened(replies: bytes) -> tuple[Connection, list[bytes]]:
    """A redis-py connection whose streams are in memory: the server's
    ``replies`` to read, and what is written collected."""
    connection = Connection()
    reader = asyncio.StreamReader()
    reader.feed_data(replies)
    sent: list[bytes] = []

    class Writer:
        transport = MemoryTransport()

        def write(self, data: bytes) -> None:
            sent.append(data)

        def is_closing(self) -> bool:
            return False

    connection._reader = reader
    connection._writer = Writer()  # type: ignore[assignment]
    return connection, sent


async def test_replies_are_read_from_a_redis_py_connections_stream() -> None:
    connection, sent = opened(b"+OK\r\n:5\r\n$3\r\nabc\r\n-NOSCRIPT No matching script\r\n")
    link = RawConnection(connection)
    assert link.usable()
    link.write(b"*1\r\n$4\r\nPING\r\n")
    assert sent == [b"*1\r\n$4\r\nPING\r\n"]
    got: list[Any] = []
    await link.replies(4, 1.0, lambda i, reply: got.append(reply))
    assert got[:3] == [b"OK", 5, b"abc"]
    # An error reply is the exception redis-py raises for it.
    assert isinstance(got[3], NoScriptError)
    connection._reader = connection._writer = None  # closed: nothing for __del__ to warn of


def test_a_redis_py_without_the_streams_read_is_named() -> None:
    class Moved:  # a connection whose streams were renamed
        _writer = None

    with pytest.raises(RedisInternalsMoved, match="Moved has no _reader"):
        RawConnection(Moved())  # type: ignore[arg-type]


def test_the_edges_internals_list_matches_what_it_uses() -> None:
    """The internals the start-up check reads include those the edge's
    source uses (a sample: a name dropped from the lists fails here)."""
    source = Path(edge.__file__).read_text("utf-8")
    for name in ("cycle", "flow", "pipeline", "parser", "server_state", "_start_asgi_task"):
        assert f"self.{name}" in source
        assert name in edge_contract.PROTOCOL_ATTRIBUTES + edge_contract.PROTOCOL_METHODS


def test_a_body_of_tiny_chunks_costs_about_its_length() -> None:
    """A chunked body sent two bytes at a time was kept as one bytes object
    a chunk: over 20 times its length in memory."""
    body = Body(65_536, [])
    for _ in range(32_768):
        body.add(b"ab")
    assert not body.too_large
    assert sys.getsizeof(body.rest) < 2 * 65_536
    assert body.whole() == b"ab" * 32_768
    body.add(b"x")  # one byte more than the limit: nothing is kept
    assert body.too_large


def test_a_body_in_one_chunk_is_not_copied() -> None:
    chunk = b'{"input":"hello"}'
    body = Body(1024, [(b"content-length", b"17")])
    body.add(chunk)
    assert body.whole() is chunk
