"""Direct mode: Redis stopped under load, with a model whose backend is a
server (``http:``): the policy's direct tiers keep getting answers from the
gateway itself, the rest a prompt 503; when Redis returns the gateway goes
back to the queue by itself, and nothing is left over in Redis. Real
processes, a real server, a real Redis killed and started again."""

import concurrent.futures
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from infergate.policies import PolicyError, parse_policy
from infergate.redis_server import RedisServer

from tests.helpers import (
    Cluster,
    as_yaml,
    http,
    key_entry,
    policy,
    redis_clean,
    wait_for,
)
from tests.upstreams import Server, batch_server

RATE = 100


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with batch_server(tmp_path_factory.mktemp("direct-server")) as s:
        yield s


LIMITED = key_entry("limited", "enterprise", "limited-secret", rate_limits=["2/minute"])
METERED = key_entry("metered", "enterprise", "metered-secret", token_limits=["100/minute"])


def direct_policy(url: str, **direct: object) -> str:
    doc = policy(tiers={"paid": {"rate_limits": ["1000/minute"]}}, extra_keys=(LIMITED, METERED))
    doc["models"] = {"default": {"backend": f"http:{url}/infer", "options": {"timeout_ms": 3000}}}
    doc["direct"] = {"tiers": ["enterprise"], **direct}
    return as_yaml(doc)


def _load(c: Cluster, seconds: float, start: int) -> list[tuple[str, int, str]]:
    """RATE requests a second, tiers mixed: (tier, status, served_by or error code)."""
    tiers = ("enterprise", "paid", "free")

    def one(i: int) -> tuple[str, int, str]:
        tier = tiers[i % 3]
        status, _, body = c.infer(tier, f"direct {start + i}")
        said = body.get("served_by") if status == 200 else body["error"]["code"]
        return tier, status, str(said)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = []
        began = time.monotonic()
        for i in range(int(RATE * seconds)):
            time.sleep(max(0.0, began + i / RATE - time.monotonic()))
            futures.append(pool.submit(one, i))
        return [f.result() for f in futures]


def _calls(server: Server) -> int:
    with urllib.request.urlopen(server.url + "/calls", timeout=5) as resp:
        return int(json.loads(resp.read())["calls"])


def _in_a_call(server: Server, before: int) -> None:
    """Until the server has taken a call past the ``before`` it had."""
    wait_for(lambda: _calls(server) > before, 5, "the server to take the call")


def _served_by(c: Cluster, tier: str) -> str | None:
    status, _, body = c.infer(tier, f"probe {time.monotonic()}")
    return body.get("served_by") if status == 200 else None


def test_redis_stopped_under_load_keeps_the_direct_tiers_served(
    tmp_path: Path, own_redis: RedisServer, server: Server
) -> None:
    with Cluster(tmp_path, own_redis.url, direct_policy(server.url), workers=1) as c:
        assert _served_by(c, "enterprise") == "model"
        own_redis.kill()
        wait_for(lambda: _served_by(c, "enterprise") == "direct", 15, "direct mode")
        during = _load(c, 3.0, 0)
        ready = http("GET", c.urls[0] + "/readyz")
        assert ready[0] == 200
        assert ready[2]["direct_mode"] is True
        own_redis.start()
        wait_for(lambda: _served_by(c, "enterprise") == "model", 30, "the queue again")
        wait_for(lambda: _served_by(c, "paid") == "model", 30, "paid served again")
        after = _load(c, 2.0, 1000)
        assert http("GET", c.urls[0] + "/readyz")[2]["direct_mode"] is False
        log = c.gateways[0].output()
        client = redis.Redis.from_url(own_redis.url)
        wait_for(lambda: redis_clean(client), 15, "Redis clean")
        client.close()
    by_tier = Counter((tier, status, said) for tier, status, said in during)
    assert {k: n for k, n in by_tier.items() if k[0] == "enterprise"} == {
        ("enterprise", 200, "direct"): RATE
    }
    assert {status for tier, status, _ in during if tier != "enterprise"} == {503}
    assert {(status, said) for _, status, said in after} == {(200, "model")}
    assert log.count("direct_mode.started") == 1
    assert log.count("direct_mode.ended") == 1


def test_past_its_cap_a_gateway_refuses_with_503(
    tmp_path: Path, own_redis: RedisServer, server: Server
) -> None:
    """``direct.max_requests`` bounds what one gateway holds (one call in
    flight, as workers.concurrency says, and the rest waiting)."""
    with Cluster(tmp_path, own_redis.url, direct_policy(server.url, max_requests=2)) as c:
        own_redis.kill()
        wait_for(lambda: _served_by(c, "enterprise") == "direct", 15, "direct mode")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            calls = _calls(server)
            first = pool.submit(c.infer, "enterprise", "__slow__ 1")
            _in_a_call(server, calls)  # (the first is in its 1.5 s call)
            more = [pool.submit(c.infer, "enterprise", f"__slow__ {i}") for i in (2, 3)]
            replies = [first.result(), *(f.result() for f in more)]
        # A key's limits are this gateway's own count meanwhile.
        limited = [c.infer("limited-secret", f"limited {i}") for i in range(3)]
        never = c.infer("metered-secret", "x", parameters={"max_tokens": 500})
        # A request that gave up (its deadline) leaves its place at once.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            calls = _calls(server)
            slow = pool.submit(c.infer, "enterprise", "__slow__ 4")
            _in_a_call(server, calls)
            gave_up = c.infer("enterprise", "short", timeout_ms=100)
            next_one = pool.submit(c.infer, "enterprise", "after it")
            later = [slow.result()[0], next_one.result()[0]]
    statuses = sorted(status for status, _, _ in replies)
    assert statuses == [200, 200, 503], replies
    refused = next(body for status, _, body in replies if status == 503)
    assert "direct.max_requests" in refused["error"]["message"]
    assert [status for status, _, _ in limited] == [200, 200, 429]
    _, headers, body = limited[2]
    assert "counted by this gateway alone" in body["error"]["message"]
    assert 1 <= int(headers["retry-after"]) <= 60
    status, headers, body = never
    assert status == 429
    assert "can never be admitted" in body["error"]["message"]
    assert "retry-after" not in headers
    assert gave_up[0] == 504
    assert later == [200, 200]


def test_a_direct_tier_the_policy_does_not_have_is_refused() -> None:
    doc = policy()
    doc["direct"] = {"tiers": ["gold"], "max_requests": 0}
    with pytest.raises(PolicyError) as caught:
        parse_policy(as_yaml(doc))
    said = str(caught.value)
    assert "direct.tiers[0]: unknown tier 'gold'" in said
    assert "direct.max_requests: must be 1-10000" in said


def test_a_backend_in_a_workers_process_fails_fast(tmp_path: Path, own_redis: RedisServer) -> None:
    """A model whose backend runs in a worker's process has no server a
    gateway can call: 503 at once, and the gateway is not ready."""
    doc = policy()
    doc["direct"] = {"tiers": ["enterprise"]}
    with Cluster(tmp_path, own_redis.url, as_yaml(doc), workers=1) as c:
        own_redis.kill()
        wait_for(
            lambda: (
                c.infer("enterprise", "x")[0] == 503
                and http("GET", c.urls[0] + "/readyz")[0] == 503
            ),
            15,
            "a prompt 503",
        )
        assert "direct_mode.started" not in c.gateways[0].output()
