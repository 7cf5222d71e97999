"""Every process's side port answers the orchestrator's probes: /healthz
while it runs, /readyz only while its heartbeat reaches Redis (dispatchers
and workers have no other HTTP port to probe)."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from infergate.redis_server import RedisServer

from tests.helpers import Cluster, free_port, http, policy_yaml, wait_for


def probe(port: int, path: str) -> int:
    try:
        return http("GET", f"http://127.0.0.1:{port}{path}", timeout=2)[0]
    except OSError:
        return 0


def test_side_port_probes_follow_redis_and_metrics_stay_served(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    cluster = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=1, metrics=True)
    try:
        ports = cluster.metrics_ports or {}
        assert {name.split("-")[0] for name in ports} == {"dispatcher0", "worker", "gateway0"}
        for port in ports.values():
            wait_for(lambda p=port: probe(p, "/readyz") == 200, 10, f"port {port} ready")
            assert probe(port, "/healthz") == 200
            status, _, body = http("GET", f"http://127.0.0.1:{port}/metrics")
            assert status == 200
            assert b"infergate_redis_up" in body
            # A mistyped probe path fails instead of passing on the metrics page.
            for wrong in ("/healthz/", "/HEALTHZ", "/%2e%2e/etc/passwd", "/"):
                assert probe(port, wrong) == 404, wrong

        own_redis.kill()
        for port in ports.values():
            wait_for(lambda p=port: probe(p, "/readyz") == 503, 15, f"port {port} not ready")
            assert probe(port, "/healthz") == 200  # alive: a restart would not bring Redis back

        own_redis.start()
        for port in ports.values():
            wait_for(lambda p=port: probe(p, "/readyz") == 200, 30, f"port {port} ready again")
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["gateway", "--policy", "loadtest/policy.yaml", "--port", "{port}"], "cannot listen on"),
        (["worker", "--metrics-port", "{port}"], "cannot serve --metrics-port"),
    ],
)
def test_a_busy_port_is_a_message_not_a_traceback(
    argv: list[str], says: str, redis_url: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = subprocess.run(
            [sys.executable, "-m", "infergate", *(a.replace("{port}", port) for a in argv),
             "--redis-url", redis_url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert says in out.stderr
    assert "Traceback" not in out.stderr


# A gateway whose edge cannot read requests through its own fault (here: a
# uvicorn internal that "moved" under the fast route).
BROKEN_EDGE_GATEWAY = """
import sys
from infergate.gateway.edge import EdgeProtocol
from infergate.main import main

def moved(self, route):
    raise AttributeError("'EdgeProtocol' object has no attribute '_start_asgi_task'")

EdgeProtocol._start_fast = moved
sys.exit(main(sys.argv[1:]))
"""


def test_a_gateway_whose_edge_is_broken_says_why_and_never_starts(
    tmp_path: Path, redis_url: str
) -> None:
    """Before it listens, a gateway drives one request down its fast route
    and one through ASGI (edge_contract.self_test): with an edge that cannot
    serve them it exits 1, naming the cause, and is never ready."""
    cluster = Cluster(tmp_path, redis_url, policy_yaml(), gateways=0, workers=1)
    port = free_port()
    try:
        out = subprocess.run(
            [sys.executable, "-c", BROKEN_EDGE_GATEWAY, "gateway", "--port", str(port),
             "--policy", str(cluster.policy_path), "--redis-url", redis_url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 1, out.stderr[-2000:]
        assert "gateway.edge_broken" in out.stderr
        assert "no attribute '_start_asgi_task'" in out.stderr
        assert "Traceback" not in out.stderr
        assert probe(port, "/readyz") == 0  # it never listened
    finally:
        cluster.stop()
