"""A lean HTTP/1.1 client for the open-loop benchmark: kept-alive
connections, requests written as prepared bytes, responses read by their
Content-Length. A load generator that shares the machine with the gateway
should cost far less per request than the gateway does (aiohttp's client
costs about 300 µs of CPU per request here; this one about a fifth of it).

Enough HTTP for the gateway's answers and nothing more: no TLS, no chunked
bodies, no redirects. A response without a Content-Length is read until the
server closes the connection.
"""

import asyncio
from collections import deque
from typing import cast
from urllib.parse import urlsplit


class HttpError(Exception):
    """The connection failed or closed before a whole response arrived."""


class _Connection(asyncio.Protocol):
    def __init__(self, pool: "HttpPool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, data: bytes, waiter: "asyncio.Future[tuple[int, bytes]]") -> None:
        assert self.transport is not None
        self.waiter = waiter
        self.buffer.clear()
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._parse(eof=False)

    def eof_received(self) -> bool:
        self._parse(eof=True)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(HttpError(type(exc).__name__ if exc else "closed"))
        self.pool.lost()

    def _parse(self, eof: bool) -> None:
        waiter = self.waiter
        if waiter is None:
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        length = -1
        at = head.find(b"\r\ncontent-length:")
        if at >= 0:
            stop = head.find(b"\r\n", at + 2)
            length = int(head[at + 17 : stop if stop >= 0 else len(head)])
        body_start = end + 4
        if length < 0:
            if not eof:
                return
            length = len(self.buffer) - body_start
        if len(self.buffer) < body_start + length:
            return
        status = int(head[9:12])
        body = bytes(self.buffer[body_start : body_start + length])
        keep = b"\r\nconnection: close" not in head
        self.waiter = None
        if keep:
            self.pool.release(self)
        elif self.transport is not None:
            self.closed = True
            self.transport.close()  # connection_lost follows
        waiter.set_result((status, body))


class HttpPool:
    """Up to ``size`` kept-alive connections to one host; requests beyond
    them wait for one to come free (the wait counts in their latency)."""

    def __init__(self, url: str, size: int) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.size = size
        self.open = 0
        self.idle: deque[_Connection] = deque()
        self.queued: deque[tuple[bytes, asyncio.Future[tuple[int, bytes]]]] = deque()
        self.connecting: set[asyncio.Task[None]] = set()

    def request(self, data: bytes) -> "asyncio.Future[tuple[int, bytes]]":
        """Send one prepared request; the future gets (status, body)."""
        waiter: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        while self.idle:
            conn = self.idle.popleft()
            if not conn.closed:
                conn.send(data, waiter)
                return waiter
        self.queued.append((data, waiter))
        self._grow()
        return waiter

    def _grow(self) -> None:
        if self.queued and self.open < self.size:
            self.open += 1
            task = asyncio.ensure_future(self._connect())
            self.connecting.add(task)
            task.add_done_callback(self.connecting.discard)

    def lost(self) -> None:
        """A connection closed (the server's keep-alive, an error, an answer
        that closed it): another may be opened for the requests waiting."""
        self.open -= 1
        self._grow()

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError as exc:
            self.open -= 1
            if self.queued:
                _, waiter = self.queued.popleft()
                if not waiter.done():
                    waiter.set_exception(HttpError(type(exc).__name__))
            self._grow()
            return
        self.release(conn)

    def release(self, conn: _Connection) -> None:
        if conn.closed:
            return
        if self.queued:
            data, waiter = self.queued.popleft()
            conn.send(data, waiter)
        else:
            self.idle.append(conn)

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


class PostTemplate:
    """A POST's request line and headers, prepared once: each request only
    adds its Content-Length and body."""

    def __init__(self, host: str, path: str, headers: dict[str, str]) -> None:
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self.head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")

    def with_body(self, body: bytes) -> bytes:
        """A complete HTTP/1.1 POST, ready to write."""
        return b"%s%d\r\n\r\n%s" % (self.head, len(body), body)
