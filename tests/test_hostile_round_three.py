"""The third hostile round: one connection that pipelines requests without
end (reading its answers or not) holds a bounded share of a gateway's
memory, and other clients are still served. Real sockets, a real stack."""

import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from infergate.redis_server import RedisServer

from tests.helpers import Cluster, as_yaml, http, policy, wait_for

FLOOD_S = 4.0


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Cluster]:
    with Cluster(
        tmp_path_factory.mktemp("round-three"),
        module_redis.url,
        as_yaml(policy()),
        workers=1,
        latency_ms=20,
    ) as c:
        yield c
        log = c.gateways[0].output()
    assert "Traceback" not in log


def _port(c: Cluster) -> int:
    return int(c.urls[0].rsplit(":", 1)[1])


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _flood(c: Cluster, request: bytes, read: bool, stop: threading.Event) -> int:
    """Pipeline ``request`` on one connection until ``stop`` (or the
    gateway closes it), reading the answers or not; returns bytes sent."""
    burst = request * max(1, 65_536 // len(request))
    sent = 0
    with socket.create_connection(("127.0.0.1", _port(c)), timeout=0.2) as sock:
        while not stop.is_set():
            try:
                sent += sock.send(burst)
            except TimeoutError:
                pass  # the gateway stopped reading: keep pushing, as an attacker would
            except OSError:
                return sent  # closed by the gateway
            if read:
                try:
                    if not sock.recv(1 << 20):
                        return sent
                except TimeoutError:
                    pass
                except OSError:
                    return sent
    return sent


def _others_served(c: Cluster, stop: threading.Event) -> list[float]:
    """Another client's /healthz latencies (s) while the flood lasts."""
    took = []
    while not stop.is_set():
        started = time.monotonic()
        status = http("GET", c.urls[0] + "/healthz", timeout=10)[0]
        took.append(time.monotonic() - started if status == 200 else 99.0)
        time.sleep(0.05)
    return took


@pytest.mark.parametrize(
    ("request_bytes", "read"),
    [
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", True),
        (
            b'POST /v1/inference HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\n\r\n{"input": "hi"}',
            True,
        ),
    ],
    ids=["healthz-never-read", "healthz-read", "inference-without-key-read"],
)
def test_one_connection_pipelining_without_end_holds_bounded_memory(
    cluster: Cluster, request_bytes: bytes, read: bool
) -> None:
    pid = cluster.gateways[0].proc.pid
    before = _rss_mib(pid)
    stop = threading.Event()
    others: list[float] = []
    watcher = threading.Thread(target=lambda: others.extend(_others_served(cluster, stop)))
    watcher.start()
    flooders = [
        threading.Thread(target=_flood, args=(cluster, request_bytes, read, stop)) for _ in range(2)
    ]
    for t in flooders:
        t.start()
    peak = before
    deadline = time.monotonic() + FLOOD_S
    while time.monotonic() < deadline:
        peak = max(peak, _rss_mib(pid))
        time.sleep(0.1)
    stop.set()
    for t in [*flooders, watcher]:
        t.join(15)
    # Seen before the bound: hundreds of MiB within seconds, and /healthz
    # taking up to 1.7 s for everyone else.
    assert peak - before < 40, f"the gateway grew from {before:.0f} to {peak:.0f} MiB"
    assert others
    assert max(others) < 2.0, f"other clients' /healthz took up to {max(others):.2f} s"
    wait_for(lambda: http("GET", cluster.urls[0] + "/healthz")[0] == 200, 10, "the gateway")


def test_requests_pipelined_past_the_cap_are_refused_after_the_answers_before(
    cluster: Cluster,
) -> None:
    """One request answered, 16 waiting behind it (``--max-pipelined``),
    and the next refused once those are answered; the connection closes."""
    data = b""
    with socket.create_connection(("127.0.0.1", _port(cluster)), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 40)
        while chunk := sock.recv(65536):
            data += chunk
    statuses = [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]
    assert statuses == [200] * 17 + [429], statuses
    assert b"read the answers before sending more" in data


def test_a_client_that_never_reads_its_answers_is_let_go(cluster: Cluster) -> None:
    """Answers pile up unread (the gateway stops reading, never more than
    the cap waiting): past the send timeout (10 s) the connection is
    closed, and other clients are served meanwhile."""
    request = b"GET /schema/openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"  # (about 40 KB each)
    with socket.create_connection(("127.0.0.1", _port(cluster)), timeout=0.2) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        started = time.monotonic()
        closed_after = None
        while time.monotonic() - started < 60:
            try:
                sock.send(request * 4)
            except TimeoutError:
                continue
            except OSError:
                closed_after = time.monotonic() - started
                break
            time.sleep(0.05)  # (not over the pipeline's cap: that closes it at once)
        assert closed_after is not None, "the connection was held for 60 s"
        assert closed_after > 10
    assert http("GET", cluster.urls[0] + "/healthz")[0] == 200
