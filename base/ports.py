"""A free TCP port for a child process to listen on (tests, `up`, benchmarks).

The port is drawn below the kernel's ephemeral range: a port the kernel picks
(bind to 0) is one it also hands out as the source port of outgoing
connections, so between the pick and the child's bind another connection
could take it ("Address already in use")."""

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _below_ephemeral() -> range:
    try:
        low = int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), low)


def free_port() -> int:
    """A port nothing listens on now, outside the ephemeral range."""
    ports = _below_ephemeral()
    for _ in range(200):
        port = random.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every draw taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
