"""Hostile clients over real sockets against a real stack: for each attack,
the documented status, a gateway whose memory stays bounded (read from
/proc), a normal request still answered meanwhile, and no traceback in the
gateway's log."""

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from infergate.redis_server import RedisServer

from tests.helpers import (
    MAX_BODY_BYTES,
    Cluster,
    as_yaml,
    auth,
    http,
    policy,
    wait_for,
    write_policy,
)

HEAD_TIMEOUT_S = 1.0
EDGE = {
    "INFERGATE_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
    "INFERGATE_BODY_TIMEOUT_S": "1",
    "INFERGATE_MAX_CONNECTIONS": "800",
}
MB = 1024 * 1024


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Cluster]:
    c = Cluster(
        tmp_path_factory.mktemp("hostile"),
        module_redis.url,
        policy_yaml_text(),
        workers=2,
        latency_ms=20,
        env=EDGE,
    )
    yield c
    c.stop()
    log = c.gateways[0].output()
    assert "Traceback" not in log
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert events, "the gateway logged no JSON line"
    assert not [e for e in events if e.get("level") == "error"]


def policy_yaml_text() -> str:
    return as_yaml(policy())


def rss(c: Cluster) -> int:
    status = Path(f"/proc/{c.gateways[0].proc.pid}/status").read_text()
    return (
        int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        * 1024
    )


def served(c: Cluster) -> bool:
    """A normal request, from a normal client, gets its answer."""
    status, _, body = c.infer("paid", "a normal request")
    return status == 200 and body["output"].endswith("a normal request")


def connect(c: Cluster) -> socket.socket:
    port = int(c.urls[0].rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def response(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed without a response: {data[:200]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, json.loads(body) if body else {}


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers


def post(
    path: str, body: bytes, *, head: str = "", length: str | None = None, version: str = "1.1"
) -> bytes:
    """A POST with the paid key: ``head`` adds header lines, ``length`` replaces
    the Content-Length (the body is sent as given)."""
    secret = auth("paid")["Authorization"]
    size = str(len(body)) if length is None else length
    return (
        f"POST {path} HTTP/{version}\r\nHost: x\r\nAuthorization: {secret}\r\n{head}"
        f"Content-Length: {size}\r\n\r\n"
    ).encode() + body


def assert_error_shape(status: int, headers: dict[str, str], body: dict, code: str) -> None:
    assert body["error"]["code"] == code, (status, body)
    assert headers["x-request-id"] == body["error"]["request_id"]
    assert set(body["error"]) >= {"code", "type", "message", "request_id"}


def test_an_endless_header_gets_431_in_bounded_memory(cluster: Cluster) -> None:
    before = rss(cluster)
    sock = connect(cluster)
    sock.sendall(b"POST /v1/inference HTTP/1.1\r\nHost: x\r\nX-Endless: ")
    sent = 0
    try:
        while sent < 100 * MB:
            sock.sendall(b"a" * 65536)
            sent += 65536
    except OSError:
        pass  # the gateway closed the connection: what it should do
    assert sent < 100 * MB, "the gateway kept reading an endless header"
    status, headers, body = response(sock)
    sock.close()
    assert status == 431
    assert_error_shape(status, headers, body, "HEADERS_TOO_LARGE")
    assert rss(cluster) - before < 20 * MB
    assert served(cluster)


def test_too_many_headers_and_one_huge_header_get_431(cluster: Cluster) -> None:
    many = "".join(f"X-H{i}: v\r\n" for i in range(100)).encode()
    huge = b"X-Huge: " + b"a" * 9000 + b"\r\n"
    # Each header and their count within limits, the head over 16 KB, in one chunk.
    wide = "".join(f"X-W{i}: {'w' * 1000}\r\n" for i in range(30)).encode()
    for extra in (many, huge, wide):
        sock = connect(cluster)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
        status, headers, body = response(sock)
        sock.close()
        assert status == 431
        assert_error_shape(status, headers, body, "HEADERS_TOO_LARGE")
    # ...while a request with no headers at all is fine.
    sock = connect(cluster)
    sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert response(sock)[0] == 200
    sock.close()
    assert served(cluster)


def test_a_slow_header_gets_408_at_the_head_timeout(cluster: Cluster) -> None:
    sock = connect(cluster)
    started = time.monotonic()
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    for byte in b"Host: slowly-slowly-slowly":
        if time.monotonic() - started > HEAD_TIMEOUT_S + 0.5:
            break
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            break
        time.sleep(0.1)  # pacing: one byte every 100 ms, as a slowloris does
    status, headers, body = response(sock)
    took = time.monotonic() - started
    sock.close()
    assert status == 408
    assert_error_shape(status, headers, body, "REQUEST_TIMEOUT")
    assert HEAD_TIMEOUT_S <= took < HEAD_TIMEOUT_S + 3
    assert served(cluster)


def test_idle_connections_are_capped_and_closed(cluster: Cluster) -> None:
    before = rss(cluster)
    idle = [connect(cluster) for _ in range(600)]
    # Under the cap: everyone else is still served while they sit there.
    assert served(cluster)
    over = [connect(cluster) for _ in range(900)]  # 1,500 in all

    def closed(sock: socket.socket) -> bool:
        sock.settimeout(0.01)
        try:
            return sock.recv(1) == b""
        except TimeoutError:
            return False
        except OSError:
            return True

    # Past the cap of 800 connections, each new one takes the place of the
    # one idle the longest (test_hostile_round_two.py: a client still gets in).
    everyone = idle + over
    wait_for(lambda: sum(map(closed, everyone)) >= 700, 5, "connections over the cap to be closed")
    # And every idle connection is closed at the head timeout.
    wait_for(
        lambda: all(map(closed, everyone)), HEAD_TIMEOUT_S + 5, "idle connections to be closed"
    )
    for sock in idle + over:
        sock.close()
    assert rss(cluster) - before < 30 * MB
    assert served(cluster)


def _post_raw(cluster: Cluster, body: bytes, secret_tier: str = "paid") -> tuple[int, dict, dict]:
    headers = {**auth(secret_tier), "Content-Type": "application/json"}
    return http("POST", cluster.urls[0] + "/v1/inference", raw=body, headers=headers)


def test_malformed_bodies_are_400_without_a_traceback(cluster: Cluster) -> None:
    cases = [
        b'{"input": "\xff\xfe"}',  # invalid UTF-8 inside a JSON string
        b'{"input": '
        + b"[" * 50_000
        + b"]" * 50_000
        + b"}",  # 100 KB of nesting: over the body limit
        b'{"input": ' + b"[" * 4_000 + b"]" * 4_000 + b"}",  # deep nesting within the limit
        b"[" * 8_000,
        b'{"input": "a", "timeout_ms": "500"}',  # wrong types
        b'{"input": "a", "timeout_ms": 1e3}',
        b'{"input": 5}',
        b'{"input": "a", "extra": 1}',
        b"",
        b"not json",
    ]
    for raw in cases:
        status, headers, body = _post_raw(cluster, raw)
        want = "PAYLOAD_TOO_LARGE" if len(raw) > MAX_BODY_BYTES else "INVALID_INPUT"
        assert status == (413 if len(raw) > MAX_BODY_BYTES else 400), (raw[:40], status, body)
        assert body["error"]["code"] == want
        assert headers["x-request-id"] == body["error"]["request_id"]
    # Without a key the body is never parsed: 401 whatever it holds.
    status, _, body = http(
        "POST", cluster.urls[0] + "/v1/inference", raw=b'{"input": "\xff"}', headers={}
    )
    assert (status, body["error"]["code"]) == (401, "UNAUTHENTICATED")
    assert served(cluster)


def _chunked(cluster: Cluster, size: int) -> tuple[int, dict[str, str], dict]:
    sock = connect(cluster)
    secret = auth("paid")["Authorization"]
    payload = json.dumps({"input": "c" * (size - 13)}).encode()
    head = (
        "POST /v1/inference HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: {secret}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunks = b"".join(
        f"{len(payload[i : i + 256]):x}\r\n".encode() + payload[i : i + 256] + b"\r\n"
        for i in range(0, len(payload), 256)
    )
    with contextlib.suppress(OSError):
        sock.sendall(head + chunks + b"0\r\n\r\n")
    try:
        return response(sock)
    finally:
        sock.close()


def test_another_transfer_coding_or_http_version_gets_400(cluster: Cluster) -> None:
    """A body in a transfer coding besides chunked would be read as plain
    chunked, and a request line of HTTP/2.0 answered as HTTP/1.1: both are
    refused, saying why."""
    secret = auth("paid")["Authorization"]
    gzip_chunked = (
        f"POST /v1/inference HTTP/1.1\r\nHost: x\r\nAuthorization: {secret}\r\n"
        "Transfer-Encoding: gzip, chunked\r\n\r\n"
        '10\r\n{"input": "abc"}\r\n0\r\n\r\n'
    ).encode()
    for raw, said in (
        (gzip_chunked, "the transfer coding 'gzip' is not supported"),
        (post("/v1/inference", b'{"input": "abc"}', version="2.0"), "HTTP/2.0: this gateway"),
    ):
        with connect(cluster) as sock:
            sock.sendall(raw)
            status, headers, body = response(sock)
        assert status == 400, body
        assert_error_shape(status, headers, body, "INVALID_INPUT")
        assert body["error"]["message"].startswith(said), body
    assert served(cluster)


def test_a_chunked_body_obeys_a_live_edited_limit(cluster: Cluster) -> None:
    assert _chunked(cluster, 1900)[0] == 200  # the limit is MAX_BODY_BYTES
    # A body limit of 3 KiB holds inputs of 512 four-byte characters (and
    # 1 KiB of JSON): the tiers' limits go down with it, or the policy check
    # refuses the edit.
    short = {tier: {"max_input_chars": 512} for tier in ("enterprise", "paid", "free")}
    edited = policy(limits={"max_body_bytes": 3072}, tiers=short)
    write_policy(cluster.policy_path, edited)
    admin = cluster.urls[0] + "/v1/admin/policy"
    wait_for(
        lambda: (
            http("GET", admin, headers=auth("admin"))[2]["policy"]["limits"]["max_body_bytes"]
            == 3072
        ),
        5,
        "the edit to apply",
    )
    try:
        status, headers, body = _chunked(cluster, 4000)
        assert status == 413
        assert_error_shape(status, headers, body, "PAYLOAD_TOO_LARGE")
        assert "date" in headers  # the server's own headers, as on every answer
        assert _chunked(cluster, 500)[0] == 200
    finally:
        write_policy(cluster.policy_path, policy())
    assert served(cluster)


def test_a_slow_body_gets_408(cluster: Cluster) -> None:
    sock = connect(cluster)
    secret = auth("paid")["Authorization"]
    sock.sendall(
        (
            "POST /v1/inference HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: {secret}\r\nContent-Length: 100\r\n\r\n"
            '{"input": "'
        ).encode()
    )
    status, headers, body = response(sock)  # nothing more is sent
    sock.close()
    assert status == 408
    assert_error_shape(status, headers, body, "REQUEST_TIMEOUT")
    assert served(cluster)


def test_pipelined_requests_are_answered_in_order_on_one_connection(cluster: Cluster) -> None:
    """The edge serves POST /v1/inference itself; pipelined requests, one of
    another route among them, still get their answers in order, and an
    HTTP/1.0 request's answer closes the connection."""

    def infer(text: str, version: str = "1.1") -> bytes:
        return post("/v1/inference", json.dumps({"input": text}).encode(), version=version)

    sock = connect(cluster)
    sock.sendall(
        infer("first")
        + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        + infer("second")
        + infer("third", "1.0")
    )
    data = b""
    while chunk := sock.recv(65536):  # until the HTTP/1.0 answer closes the connection
        data += chunk
    sock.close()
    answers = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        status, headers = parse_head(head)
        size = int(headers["content-length"])
        answers.append((status, headers, json.loads(data[:size])))
        data = data[size:]
    assert [a[0] for a in answers] == [200, 200, 200, 200]
    assert answers[0][2]["output"].endswith("first")
    assert answers[1][2] == {"status": "ok"}
    assert answers[2][2]["output"].endswith("second")
    assert answers[3][2]["output"].endswith("third")
    assert answers[3][1]["connection"] == "close"
    assert all(a[1]["x-request-id"] for a in answers[::2])


def test_expect_100_continue_gets_its_interim_answer(cluster: Cluster) -> None:
    body = json.dumps({"input": "after the interim"}).encode()
    sock = connect(cluster)
    sock.sendall(post("/v1/inference", b"", head="Expect: 100-continue\r\n", length=str(len(body))))
    assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    sock.sendall(body)
    status, _, answer = response(sock)
    sock.close()
    assert status == 200
    assert answer["output"].endswith("after the interim")


def test_a_client_leaving_with_pipelined_requests_in_flight_costs_no_traceback(
    cluster: Cluster,
) -> None:
    """The connection's first request is answered to a closed socket: nothing
    is written, nothing is logged as an error (checked at teardown)."""
    one = post("/v1/inference", json.dumps({"input": "left early"}).encode())
    for _ in range(5):
        sock = connect(cluster)
        sock.sendall(one * 3)
        sock.close()
    assert served(cluster)


def test_a_content_length_with_thousands_of_leading_zeros_is_still_a_length(
    cluster: Cluster,
) -> None:
    body = json.dumps({"input": "zeros"}).encode()
    sock = connect(cluster)
    sock.sendall(post("/v1/inference", body, length=f"{'0' * 5000}{len(body)}"))
    status, _, answer = response(sock)
    sock.close()
    assert status == 200
    assert answer["output"].endswith("zeros")
    # One the parser cannot read as a length (it overflows) is not HTTP: 400,
    # in the one error shape.
    sock = connect(cluster)
    sock.sendall(post("/v1/inference", b"", length=f"9{'0' * 40}"))
    try:
        status, headers, answer = response(sock)
    finally:
        sock.close()
    assert status == 400
    assert_error_shape(status, headers, answer, "INVALID_INPUT")
    assert "date" in headers
    assert served(cluster)


def test_a_zero_padded_length_on_an_asgi_route_is_no_500(cluster: Cluster) -> None:
    body = json.dumps({"input": "a job"}).encode()
    sock = connect(cluster)
    sock.sendall(post("/v1/jobs", body, length=f"{'0' * 5000}{len(body)}"))
    try:
        status, _, _ = response(sock)
    finally:
        sock.close()
    assert status < 500


def test_unreadable_http_repeated_does_not_flood_the_log(cluster: Cluster) -> None:
    for _ in range(30):
        sock = connect(cluster)
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        try:
            status, headers, body = response(sock)
        finally:
            sock.close()
        assert status == 400
        assert_error_shape(status, headers, body, "INVALID_INPUT")
    assert cluster.gateways[0].output().count("Invalid HTTP request") == 0
    assert served(cluster)
