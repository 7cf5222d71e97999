"""The gateway's edge limits and their defaults: one place, read by the
command-line flags (``infergate gateway --help``), the HTTP protocol
(``edge.py``) and the body reader (``middleware.py``); and the body's size
limit (the live policy's), kept by one ``Body`` wherever a body is read."""

from collections.abc import Iterable
from dataclasses import dataclass

from infergate.gateway.errors import ApiError


@dataclass(frozen=True)
class EdgeLimits:
    # The request line and headers together; one header; how many (431).
    max_head_bytes: int = 16_384
    max_header_bytes: int = 8_192
    max_headers: int = 64
    # From the connection opening (or the next request's first byte) to the
    # end of its head (408; a connection that sent nothing is just closed).
    head_timeout_s: float = 10.0
    # From the end of the head to the end of the body (408).
    body_timeout_s: float = 10.0
    # Idle time before a kept-alive connection is closed.
    keep_alive_s: float = 5.0
    # Open connections per gateway process; one more is closed when accepted.
    max_connections: int = 1_000
    # Requests one connection may have waiting behind the one being answered
    # (HTTP pipelining); one more is refused (429) and the connection closed.
    max_pipelined: int = 16
    # How long an answer may sit unread by its client before the connection
    # is closed (the gateway reads nothing more from it meanwhile).
    send_timeout_s: float = 10.0


def content_length(value: bytes) -> int:
    """A Content-Length header's number (the HTTP parser checked its form;
    0 if it is not one). One too long to read, even zero-padded, is larger
    than any body limit."""
    digits = value.lstrip(b"0")
    if len(digits) > 18:
        return 1 << 62
    return int(digits) if digits.isdigit() else 0


def declared_length(headers: Iterable[tuple[bytes, bytes]]) -> int:
    for name, value in headers:
        if name == b"content-length":
            return content_length(value)
    return 0


class Body:
    """One request's body, kept up to its limit: past it (or declared past
    it) nothing more is kept, so a body costs O(limit) memory whatever the
    client sends, however small its chunks (after the first, they go into
    one buffer, not a list). The limit is read once, when the head is in."""

    __slots__ = ("first", "limit", "rest", "size", "too_large")

    def __init__(self, limit: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.limit = limit
        self.first = b""
        self.rest: bytearray | None = None
        self.size = 0
        self.too_large = declared_length(headers) > limit

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            self.too_large = True
            self.first, self.rest = b"", None
        elif self.too_large:
            pass
        elif self.rest is not None:
            self.rest += chunk
        elif self.first:
            self.rest = bytearray(self.first)
            self.rest += chunk
        else:
            self.first = chunk

    def whole(self) -> bytes:
        body = self.first if self.rest is None else bytes(self.rest)
        self.first, self.rest = b"", None
        return body

    def error(self) -> ApiError:
        return ApiError("PAYLOAD_TOO_LARGE", f"the request body is over {self.limit} bytes")
