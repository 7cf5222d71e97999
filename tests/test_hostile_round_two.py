"""The second hostile round, at the edge: requests that ask to switch
protocol, long polls holding a gateway's connections, two Authorization
headers, and errors that name what was wrong. Real sockets, a real stack."""

import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from infergate.redis_server import RedisServer

from tests.helpers import SECRETS, Cluster, as_yaml, auth, http, policy, wait_for

MAX_CONNECTIONS = 200
SHARE = 0.25  # of MAX_CONNECTIONS: 50 waiting requests per key
PER_KEY = int(MAX_CONNECTIONS * SHARE)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Cluster]:
    doc = policy(limits={"key_connection_share": SHARE})
    with Cluster(
        tmp_path_factory.mktemp("round-two"),
        module_redis.url,
        as_yaml(doc),
        workers=1,
        latency_ms=20,
        env={
            "INFERGATE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "INFERGATE_HEAD_TIMEOUT_S": "2",
            "INFERGATE_BODY_TIMEOUT_S": "1",
        },
    ) as c:
        yield c
        log = c.gateways[0].output()
    assert "Traceback" not in log
    # uvicorn's own lines for an upgrade it cannot make are never printed.
    assert "Unsupported upgrade request" not in log
    assert "WebSocket library" not in log


def _port(c: Cluster) -> int:
    return int(c.urls[0].rsplit(":", 1)[1])


def _exchange(c: Cluster, raw: bytes, timeout_s: float = 5.0) -> bytes:
    """Send ``raw`` and read until the server closes the connection (a
    server that never does fails the test at the timeout)."""
    with socket.create_connection(("127.0.0.1", _port(c)), timeout=timeout_s) as sock:
        sock.sendall(raw)
        data = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    raise AssertionError(f"the connection was not closed within {timeout_s} s: {data[:300]!r}")


def _status_and_body(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _served(c: Cluster) -> bool:
    status, _, body = c.infer("paid", "still served")
    return status == 200 and body["output"].endswith("still served")


@pytest.mark.parametrize(
    ("upgrade", "method", "target"),
    [
        ("websocket", "POST", "/v1/inference"),
        ("websocket", "GET", "/healthz"),
        ("h2c", "POST", "/v1/inference"),
        ("h2c", "POST", "/v1/jobs"),
        ("whatever/1", "GET", "/v1/status"),
    ],
)
def test_a_request_to_switch_protocol_is_400_and_closed(
    cluster: Cluster, upgrade: str, method: str, target: str
) -> None:
    body = json.dumps({"input": "hello"}).encode()
    raw = (
        f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        f"Upgrade: {upgrade}\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {SECRETS['paid']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    status, answer = _status_and_body(_exchange(cluster, raw))
    assert status == 400
    assert answer["error"]["code"] == "INVALID_INPUT"
    assert "does not switch protocols" in answer["error"]["message"]
    assert _served(cluster)


def test_connect_is_400_and_closed(cluster: Cluster) -> None:
    status, answer = _status_and_body(
        _exchange(cluster, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    )
    assert (status, answer["error"]["code"]) == (400, "INVALID_INPUT")


def test_many_upgrade_requests_cannot_hold_the_connection_cap(cluster: Cluster) -> None:
    """More upgrade requests than the gateway takes connections, all left
    open by their sender: each is answered and closed, and /healthz still
    answers afterwards."""
    raw = (
        b"POST /v1/inference HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Content-Length: 5\r\n\r\nhello"
    )
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 20):
            sock = socket.create_connection(("127.0.0.1", _port(cluster)), timeout=5)
            sock.sendall(raw)
            socks.append(sock)
        for sock in socks:
            data = b""
            while chunk := sock.recv(65536):  # the server closes each one
                data += chunk
            assert data == b"" or data.startswith(b"HTTP/1.1 400 ")
    finally:
        for sock in socks:
            sock.close()
    assert http("GET", cluster.urls[0] + "/healthz")[0] == 200


@pytest.mark.parametrize(
    "second",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["an-upgrade", "unreadable-bytes"],
)
def test_a_request_pipelined_before_a_refused_one_keeps_its_answer(
    cluster: Cluster, second: bytes
) -> None:
    body = json.dumps({"input": "first in line"}).encode()
    first = (
        f"POST /v1/inference HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRETS['paid']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    data = _exchange(cluster, first + second)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), data[:300]
    length = int(
        next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))[15:]
    )
    assert json.loads(rest[:length])["output"].endswith("first in line")
    status, answer = _status_and_body(rest[length:])
    assert (status, answer["error"]["code"]) == (400, "INVALID_INPUT")


def test_kept_alive_connections_cannot_hold_the_connection_cap(cluster: Cluster) -> None:
    """More connections than the cap, each kept alive by a cheap request
    (no key needed): a new client still gets in, in the place of the one
    idle the longest."""
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 20):
            sock = socket.create_connection(("127.0.0.1", _port(cluster)), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(sock)
        for sock in socks[-50:]:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert _served(cluster)
        assert http("GET", cluster.urls[0] + "/healthz")[0] == 200
    finally:
        for sock in socks:
            sock.close()


def test_two_authorization_headers_are_refused_everywhere(cluster: Cluster) -> None:
    two = f"Authorization: Bearer {SECRETS['free']}\r\nAuthorization: Bearer {SECRETS['admin']}\r\n"
    body = b'{"input": "x"}'
    for method, target in (
        ("POST", "/v1/inference"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs/" + "0" * 32),
        ("GET", "/v1/status"),
        ("GET", "/v1/admin/policy"),
    ):
        raw = (
            f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{two}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        status, answer = _status_and_body(_exchange(cluster, raw))
        assert (status, answer["error"]["code"]) == (401, "UNAUTHENTICATED"), target
        assert "more than one Authorization header" in answer["error"]["message"]


def test_a_bad_wait_s_is_named_as_a_query_parameter(cluster: Cluster) -> None:
    url = cluster.urls[0] + "/v1/jobs/" + "0" * 32 + "?wait_s=99"
    status, _, body = http("GET", url, headers=auth("free"))
    assert (status, body["error"]["code"]) == (400, "INVALID_INPUT")
    assert body["error"]["message"].startswith("invalid query parameter:")
    assert "wait_s" in body["error"]["message"]


def test_long_polls_of_one_key_hold_at_most_its_share(cluster: Cluster) -> None:
    """One key's long polls take at most its share of the gateway's
    connections (429 past it, at once); another key, and /healthz, still
    get through while they wait."""
    cluster.stop_workers()  # nothing runs: a job stays queued, its polls wait
    try:
        status, _, job = http(
            "POST", cluster.urls[0] + "/v1/jobs", {"input": "queued"}, auth("free")
        )
        assert status == 202
        url = f"{cluster.urls[0]}/v1/jobs/{job['job_id']}?wait_s=6"

        def poll(_: int) -> tuple[int, float]:
            started = time.monotonic()
            status = http("GET", url, headers=auth("free"), timeout=20)[0]
            return status, time.monotonic() - started

        with concurrent.futures.ThreadPoolExecutor(PER_KEY + 10) as pool:
            polls = [pool.submit(poll, i) for i in range(PER_KEY + 10)]
            wait_for(lambda: _established(cluster) >= PER_KEY, 10, "the polls to be held")
            other = http("GET", cluster.urls[0] + "/v1/jobs/" + "0" * 32, headers=auth("paid"))
            assert other[0] == 404  # another key is served meanwhile
            assert http("GET", cluster.urls[0] + "/healthz")[0] == 200
            results = [f.result() for f in polls]
        refused = [seconds for status, seconds in results if status == 429]
        assert len(refused) == 10
        assert max(refused) < 3  # refused at once, not after a wait
        assert sorted(status for status, _ in results if status != 429) == [200] * PER_KEY
        # Polls whose clients leave let go of their holds at once, not at wait_s.
        gone = [_raw_poll(cluster, url.replace("wait_s=6", "wait_s=15")) for _ in range(PER_KEY)]
        brief = url.replace("wait_s=6", "wait_s=0.1")
        wait_for(
            lambda: http("GET", brief, headers=auth("free"))[0] == 429, 10, "the polls to be held"
        )
        for sock in gone:
            sock.close()
        wait_for(
            lambda: (
                http("GET", url.replace("wait_s=6", "wait_s=0.1"), headers=auth("free"))[0] == 200
            ),
            5,
            "the holds of clients gone to be let go",
        )
    finally:
        cluster.add_worker()
        wait_for(lambda: _served(cluster), 30, "a worker to serve again")


def _raw_poll(c: Cluster, url: str) -> socket.socket:
    """A long poll sent on a socket of its own (closed by the caller)."""
    target = url.split(str(_port(c)), 1)[1]
    sock = socket.create_connection(("127.0.0.1", _port(c)), timeout=5)
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n{_auth_line('free')}\r\n".encode())
    return sock


def _auth_line(tier: str) -> str:
    return f"Authorization: {auth(tier)['Authorization']}\r\n"


def _established(c: Cluster) -> int:
    """The gateway's open connections, as /proc counts them (its sockets
    in ESTABLISHED on its port)."""
    port = f"{_port(c):04X}"
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(":" + port) and fields[3] == "01":
            count += 1
    return count


def test_a_pipelined_body_is_not_timed_while_it_waits_its_turn(cluster: Cluster) -> None:
    """A request pipelined behind one the app holds cannot send its body
    (reading is paused): its body's time starts when its turn comes, and
    the answer before it goes out first."""
    cluster.stop_workers()  # nothing runs: a job stays queued, its poll waits
    try:
        status, _, job = http("POST", cluster.urls[0] + "/v1/jobs", {"input": "q"}, auth("free"))
        assert status == 202
        poll = (
            f"GET /v1/jobs/{job['job_id']}?wait_s=3 HTTP/1.1\r\nHost: x\r\n{_auth_line('free')}\r\n"
        ).encode()
        partial = (
            f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n{_auth_line('free')}"
            'Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{"input": '
        ).encode()
        data = _exchange(cluster, poll + partial, timeout_s=15)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), data[:300]  # the poll's answer, first
        assert b"HTTP/1.1 408 " in rest  # then the body that never came
    finally:
        cluster.add_worker()
        wait_for(lambda: _served(cluster), 30, "a worker to serve again")
