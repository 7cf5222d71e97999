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
  of the request's first byte: 408, connection closed (a connection that
  sent nothing is just closed);
- at most ``max_connections`` open connections per process: one more is
  closed as soon as it is accepted.

The idle keep-alive time is uvicorn's ``timeout_keep_alive``; the body's
size and time limits are in ``middleware.py``. Each refusal is one info log
line (rate-limited), never a traceback, and costs O(limit) memory: what a
chunk of the socket can bring beyond the limit is never kept.
"""

import asyncio
from typing import Any

import msgspec
from infergate.base import logs
from infergate.gateway.errors import ApiError
from infergate.gateway.limits import EdgeLimits
from infergate.gateway.middleware import new_request_id
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logs.get(__name__)


def error_response(error: ApiError, request_id: str) -> bytes:
    """A complete HTTP/1.1 response in the one error shape, closing the connection."""
    body = msgspec.json.encode(error.body(request_id))
    head = [
        f"HTTP/1.1 {error.status} {_REASONS.get(error.status, '')}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{k}: {v}" for k, v in error.all_headers().items()),
    ]
    head.append(f"x-request-id: {request_id}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above."""

    limits = EdgeLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._refused = False
        self._head_bytes = 0
        self._headers = 0
        self._head_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_limits(cls, limits: EdgeLimits) -> type["EdgeProtocol"]:
        return type("EdgeProtocol", (cls,), {"limits": limits})

    # -- connection --------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logs.limited(log, "edge.too_many_connections", limit=self.limits.max_connections)
            transport.abort()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Still inside the head after this chunk, and past the limit: the
        # parser holds at most the limit plus one chunk.
        if self._in_head and self._head_bytes > self.limits.max_head_bytes:
            self._refuse(431, f"the request head is over {self.limits.max_head_bytes} bytes")

    # -- parser callbacks ----------------------------------------------------

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        if not self._in_head:  # the next request on a kept-alive connection
            self._in_head = True
            self._head_bytes = 0
            self._arm_head_timer()
        self._headers = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._headers += 1
        if self._headers > self.limits.max_headers:
            self._refuse(431, f"more than {self.limits.max_headers} headers")
            return
        if len(name) + len(value) > self.limits.max_header_bytes:
            self._refuse(431, f"a header is over {self.limits.max_header_bytes} bytes")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        if not self._refused:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    # -- limits ----------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport is None or self.transport.is_closing():
            return
        if self._head_bytes == 0:
            logs.limited(log, "edge.idle_connection_closed", after_s=self.limits.head_timeout_s)
            self.transport.close()
            return
        self._refuse(
            408, f"the request head did not arrive within {self.limits.head_timeout_s:g} s"
        )

    def _refuse(self, status: int, message: str) -> None:
        code = "REQUEST_TIMEOUT" if status == 408 else "HEADERS_TOO_LARGE"
        logs.limited(log, "edge.refused", status=status, code=code)
        self._disarm_head_timer()
        self._in_head = False
        self._refused = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(error_response(ApiError(code, message), new_request_id()))
        transport.close()
        # Nothing more is parsed from this connection.
        self.parser = _Closed()  # type: ignore[assignment]


class _Closed:
    """Stands in for the parser once a connection has been refused."""

    def feed_data(self, data: bytes) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)
