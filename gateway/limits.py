"""The gateway's edge limits and their defaults: one place, read by the
command-line flags (``infergate gateway --help``), the HTTP protocol
(``edge.py``) and the body reader (``middleware.py``)."""

from dataclasses import dataclass


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
