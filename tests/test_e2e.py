"""End to end: real processes (``infergate up`` and single components) on a
real Redis, driven over HTTP."""

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
from infergate.base import wire
from infergate.base.keys import Keys
from infergate.base.ports import free_port
from infergate.base.queue.inputs import BESIDE_MIN_CHARS
from infergate.gpu.backends.simulated import sim_output
from infergate.redis_server import RedisServer

from tests.helpers import (
    SECRETS,
    Proc,
    Stack,
    auth,
    children_of,
    cmdline,
    http,
    pid_alive,
    policy_yaml,
    wait_for,
)

ERROR_FIELDS = {"code", "type", "message", "request_id"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer) -> Iterator[Stack]:
    s = Stack(
        tmp_path_factory.mktemp("main"),
        module_redis.url,
        workers=4,
        gateways=2,
        policy=policy_yaml(),
    )
    yield s
    s.stop()


def assert_error(
    status: int, headers: dict[str, str], body: object, want_status: int, want_code: str
) -> None:
    assert status == want_status, body
    assert isinstance(body, dict), body
    assert set(body["error"]) >= ERROR_FIELDS, body
    assert body["error"]["code"] == want_code
    assert headers["x-request-id"] == body["error"]["request_id"]


async def _post(session: aiohttp.ClientSession, url: str, tier: str, text: str) -> tuple[int, dict]:
    async with session.post(
        url + "/v1/inference", json={"input": text}, headers=auth(tier)
    ) as resp:
        return resp.status, await resp.json()


async def test_hundreds_of_concurrent_requests_each_get_their_own_output(
    stack: Stack, module_redis: RedisServer
) -> None:
    tiers = ["free", "paid", "enterprise"]
    texts = [f"req-{i}-{tiers[i % 3]}" for i in range(400)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=400)) as session:
        results = await asyncio.gather(
            *(_post(session, stack.url, tiers[i % 3], t) for i, t in enumerate(texts))
        )
    assert [status for status, _ in results] == [200] * 400, [b for s, b in results if s != 200][:3]
    for text, (_, body) in zip(texts, results, strict=True):
        assert body["output"] == sim_output(text)
    assert len({body["request_id"] for _, body in results}) == 400
    assert max(body["batch_size"] for _, body in results) > 1
    assert {body["tier"] for _, body in results} == set(tiers)
    # Both gateway processes answered part of the traffic.
    client = redis.Redis.from_url(module_redis.url)
    keys = Keys()

    def both_served() -> bool:
        ids = [m.decode() for m in client.smembers(keys.members("gateway"))]
        beats = [client.get(keys.heartbeat("gateway", i)) for i in ids]
        served = [wire.decode_heartbeat(b).requests_done for b in beats if b]
        return len(served) == 2 and all(n > 0 for n in served) and sum(served) >= 400

    wait_for(both_served, 5, "both gateways to report the requests they served")
    client.close()


async def test_long_inputs_are_answered_and_leave_nothing_behind(
    stack: Stack, module_redis: RedisServer
) -> None:
    """Inputs of ``BESIDE_MIN_CHARS`` or more wait beside the queue (stored
    by the admit, fetched by the worker, deleted with the answer): mixed in
    batches with short ones, each request gets its own output."""
    texts = [f"{i}:" + "long input " * (BESIDE_MIN_CHARS // 10) for i in range(60)]
    texts += [f"short {i}" for i in range(30)]
    assert all(len(t) >= BESIDE_MIN_CHARS for t in texts[:60])
    client = redis.Redis.from_url(module_redis.url)

    def mgets() -> int:
        return int(client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))

    fetched_before = mgets()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as session:
        results = await asyncio.gather(*(_post(session, stack.url, "enterprise", t) for t in texts))
    assert [status for status, _ in results] == [200] * 90, [b for s, b in results if s != 200][:3]
    for text, (_, body) in zip(texts, results, strict=True):
        assert body["output"] == sim_output(text)
    assert max(body["batch_size"] for _, body in results) > 1
    # The long ones waited beside the queue: workers fetched them.
    assert mgets() > fetched_before
    # Deleted in the transaction that published each answer.
    assert list(client.scan_iter(Keys().input_prefix + "*")) == []
    client.close()


def test_deadline_gives_504(stack: Stack) -> None:
    status, headers, body = stack.infer("paid", "slow", timeout_ms=30)
    assert_error(status, headers, body, 504, "TIMEOUT")


@pytest.mark.parametrize(
    ("headers", "payload", "status", "code"),
    [
        (auth("free"), b'{"input": "x"', 400, "INVALID_INPUT"),
        (auth("free"), b"{}", 400, "INVALID_INPUT"),
        (auth("free"), b'{"input": 5}', 400, "INVALID_INPUT"),
        (auth("free"), b'{"input": ""}', 400, "INVALID_INPUT"),
        (auth("free"), json.dumps({"input": "y" * 1001}).encode(), 400, "INVALID_INPUT"),
        (auth("free"), b'{"input": "x", "colour": "red"}', 400, "INVALID_INPUT"),
        (auth("free"), b'{"input": "x", "timeout_ms": 0}', 400, "INVALID_INPUT"),
        (auth("free"), b"\xff\xfe not utf-8", 400, "INVALID_INPUT"),
        ({}, b'{"input": "x"}', 401, "UNAUTHENTICATED"),
        ({"Authorization": "Bearer nope"}, b'{"input": "x"}', 401, "UNAUTHENTICATED"),
        ({"Authorization": "Basic " + SECRETS["free"]}, b'{"input": "x"}', 401, "UNAUTHENTICATED"),
        (
            {"Authorization": "Bearer " + SECRETS["disabled"]},
            b'{"input": "x"}',
            403,
            "KEY_DISABLED",
        ),
        (auth("free"), json.dumps({"input": "z" * 20_000}).encode(), 413, "PAYLOAD_TOO_LARGE"),
    ],
)
def test_error_rows(
    stack: Stack, headers: dict[str, str], payload: bytes, status: int, code: str
) -> None:
    got_status, got_headers, body = http(
        "POST",
        stack.url + "/v1/inference",
        raw=payload,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert_error(got_status, got_headers, body, status, code)


def test_unknown_route_has_the_error_shape(stack: Stack) -> None:
    status, headers, body = http("GET", stack.url + "/v1/nothing")
    assert_error(status, headers, body, 404, "NOT_FOUND")


def test_health_ready_and_status(stack: Stack) -> None:
    assert http("GET", stack.url + "/healthz")[0] == 200
    status, headers, body = http("GET", stack.url + "/readyz")
    assert status == 200
    assert body["workers_alive"] == 4
    assert "x-request-id" in headers
    assert stack.infer("enterprise", "status please")[0] == 200
    # Fleet detail is for operators: an admin key.
    assert http("GET", stack.url + "/v1/status")[0] == 401
    assert http("GET", stack.url + "/v1/status", headers=auth("paid"))[0] == 403
    status, _, body = http("GET", stack.url + "/v1/status", headers=auth("admin"))
    assert status == 200
    assert body["workers_alive"] == 4
    assert len(body["workers"]) == 4
    assert body["dispatchers_alive"] == 1
    assert body["gateways_alive"] == 2
    assert set(body["queue_depth"]) == {"enterprise", "paid", "free"}
    assert body["batches_formed"] >= 1
    assert body["mean_batch_size"] >= 1
    assert all(w["capacity_rps"] > 0 and w["batch_ms"] > 0 for w in body["workers"])
    assert not any(w["draining"] for w in body["workers"])
    assert set(body["counters"]) >= {
        "batches_formed",
        "requests_batched",
        "expired_dropped",
        "cancelled_dropped",
        "malformed_dropped",
        "requeued",
        "batches_retried",
        "batches_dead_lettered",
    }
    assert body["policy_error"] is None


def test_openapi_document_describes_the_api(stack: Stack) -> None:
    status, _, doc = http("GET", stack.url + "/schema/openapi.json")
    assert status == 200
    op = doc["paths"]["/v1/inference"]["post"]
    assert set(op["responses"]) >= {"200", "400", "401", "403", "413", "500", "503", "504"}
    body = op["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == {"input", "timeout_ms", "model", "parameters"}
    assert body["required"] == ["input"]
    assert body["additionalProperties"] is False
    assert set(doc["components"]["schemas"]["InferenceResponse"]["required"]) >= {
        "request_id",
        "output",
        "latency_ms",
        "tier",
        "batch_size",
        "queue_ms",
    }
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


async def test_enterprise_sent_after_a_free_backlog_is_answered_first(
    tmp_path: Path, module_redis: RedisServer
) -> None:
    policy = policy_yaml(max_batch_size=10)
    s = Stack(
        tmp_path, module_redis.url, workers=1, latency_ms=200, policy=policy, namespace="prio"
    )
    client = redis.Redis.from_url(module_redis.url)
    done: list[str] = []

    async def one(session: aiohttp.ClientSession, tier: str, i: int) -> int:
        status, _ = await _post(session, s.url, tier, f"{tier}-{i}")
        done.append(tier)
        return status

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as session:
            free = [asyncio.create_task(one(session, "free", i)) for i in range(50)]
            queue = Keys("prio").fair_queue("free")
            deadline = time.monotonic() + 10
            while client.zcard(queue) < 30:
                assert time.monotonic() < deadline, "the free backlog never formed"
                await asyncio.sleep(0.01)
            enterprise = [asyncio.create_task(one(session, "enterprise", i)) for i in range(5)]
            statuses = await asyncio.gather(*free, *enterprise)
        assert statuses == [200] * 55
        last_enterprise = max(i for i, tier in enumerate(done) if tier == "enterprise")
        free_before = done[:last_enterprise].count("free")
        # 50 free were queued first; the 5 enterprise went in the next batch.
        assert free_before <= 20, done
    finally:
        client.close()
        s.stop()


def _lone_gateway(tmp_path: Path, redis_url: str, namespace: str) -> tuple[Proc, str]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml())
    port = free_port()
    proc = Proc(
        ["gateway", "--port", str(port), "--policy", str(policy), "--namespace", namespace],
        {"REDIS_URL": redis_url},
        tmp_path / "gateway.log",
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.alive(), proc.output()
        try:
            return http("GET", url + "/healthz", timeout=1)[0] == 200
        except OSError:
            return False

    wait_for(up, 30, "the gateway to listen")
    return proc, url


def test_no_healthy_worker_gives_503_at_once(tmp_path: Path, module_redis: RedisServer) -> None:
    proc, url = _lone_gateway(tmp_path, module_redis.url, "lonely")
    try:
        started = time.monotonic()
        status, headers, body = http(
            "POST", url + "/v1/inference", {"input": "x"}, auth("enterprise")
        )
        assert time.monotonic() - started < 2.0
        assert_error(status, headers, body, 503, "SERVICE_OVERLOADED")
        assert int(headers["retry-after"]) >= 1
        assert int(headers["retry-after-ms"]) > 0
        assert http("GET", url + "/readyz")[0] == 503
    finally:
        proc.stop()


def test_redis_unreachable_gives_503_fast(tmp_path: Path, own_redis: RedisServer) -> None:
    own = own_redis
    gateway, url = _lone_gateway(tmp_path, own.url, "infergate")
    worker = Proc(
        ["worker", "--sim-latency-ms", "10"], {"REDIS_URL": own.url}, tmp_path / "worker.log"
    )
    dispatcher = Proc(["dispatcher"], {"REDIS_URL": own.url}, tmp_path / "dispatcher.log")
    try:
        wait_for(lambda: http("GET", url + "/readyz")[0] == 200, 30, "readiness")
        assert http("POST", url + "/v1/inference", {"input": "x"}, auth("free"))[0] == 200
        own.kill()

        def refused() -> bool:
            started = time.monotonic()
            status, headers, body = http(
                "POST", url + "/v1/inference", {"input": "x"}, auth("free")
            )
            assert time.monotonic() - started < 3.0, "a request hung while Redis was down"
            if status == 503:
                assert_error(status, headers, body, 503, "SERVICE_OVERLOADED")
                return True
            return False

        wait_for(refused, 5, "503 while Redis is down")
        assert http("GET", url + "/readyz")[0] == 503
    finally:
        for p in (gateway, worker, dispatcher):
            p.stop()


def test_up_stops_every_child_on_sigint(tmp_path: Path) -> None:
    port = free_port()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # No REDIS_URL: `up` starts (and must stop) its own redis-server.
    proc = Proc(
        ["up", "--port", str(port), "--workers", "2", "--keys-out", str(tmp_path / "k.json")],
        {"TMPDIR": str(scratch)},
        tmp_path / "up.log",
    )
    try:

        def ready() -> bool:
            assert proc.alive(), proc.output()
            try:
                return http("GET", f"http://127.0.0.1:{port}/readyz", timeout=1)[0] == 200
            except OSError:
                return False

        wait_for(ready, 60, "up to be ready")
        keys = json.loads((tmp_path / "k.json").read_text())
        assert set(keys) == {"enterprise", "paid", "free"}
        assert (tmp_path / "k.json").stat().st_mode & 0o777 == 0o600  # secrets: owner only
        assert sorted(p.name.split("-")[1] for p in scratch.iterdir()) == ["redis", "up"]
        status, _, body = http(
            "POST",
            f"http://127.0.0.1:{port}/v1/inference",
            {"input": "hi"},
            {"Authorization": "Bearer " + keys["free"]},
        )
        assert status == 200
        assert body["output"] == sim_output("hi")
        children = children_of(proc.proc.pid)
        roles = " ".join(cmdline(pid) for pid in children)
        for role in (
            "infergate worker",
            "infergate dispatcher",
            "infergate gateway",
            "redis-server",
        ):
            assert role in roles, roles
        proc.signal(signal.SIGINT)
        assert proc.wait(20) == 0
        wait_for(lambda: not any(pid_alive(pid) for pid in children), 5, "every child to exit")
        assert list(scratch.iterdir()) == []  # its Redis and demo-policy folders are gone
    finally:
        proc.stop()


def test_up_fails_clearly_when_a_part_cannot_start(
    tmp_path: Path, module_redis: RedisServer
) -> None:
    """A worker whose code does not import: up stops, and says which part
    and why (a busy port or a bad spec is said before anything starts:
    tests/test_up.py)."""
    proc = Proc(
        ["up", "--port", str(free_port()), "--workers", "1", "--namespace", "fails",
         "--backend", "python:nomodule:batchstring"],
        {"REDIS_URL": module_redis.url},
        tmp_path / "up.log",
    )  # fmt: skip
    try:
        code = proc.wait(60)
        assert code != 0
        output = proc.output()
        assert "worker-1 failed to start (exit code 2)" in output
        assert "cannot import nomodule: ModuleNotFoundError" in output
    finally:
        proc.stop()
