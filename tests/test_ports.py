"""A child's port is drawn where the kernel's outgoing connections never land."""

import socket
from pathlib import Path

from infergate.base.ports import free_port


def ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low = ephemeral_low()
    for _ in range(50):
        port = free_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_never_drawn() -> None:
    listeners = []
    try:
        taken = set()
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            listeners.append(s)
            taken.add(s.getsockname()[1])
        assert len(taken) == 200
    finally:
        for s in listeners:
            s.close()
