"""Backpressure before Redis is full: past the policy's high-water mark of
``maxmemory`` a gateway refuses new work, free first, then paid, enterprise
last, before Redis itself refuses a write; it recovers by itself below the
mark. A real stack on a real Redis whose maxmemory the test sets."""

import threading
from collections.abc import Iterator

import pytest
import redis
from infergate.base.queue.store import memory_use_of
from infergate.gateway.redis_memory import tier_mark
from infergate.redis_server import RedisServer

from tests.helpers import Cluster, as_yaml, auth, http, policy, wait_for, write_policy

JUNK = b"j" * 100_000


def test_a_memory_reading_is_used_over_maxmemory_or_none() -> None:
    kept = b"maxmemory_policy:noeviction\r\n"
    info = b"# Memory\r\nused_memory:800\r\nused_memory_human:800B\r\nmaxmemory:1000\r\n"
    assert memory_use_of(info + kept) == 0.8
    assert memory_use_of(b"used_memory:800\r\nmaxmemory:0\r\n" + kept) is None  # no maxmemory
    # A Redis that evicts keeps its use near 1 by design: no mark.
    assert memory_use_of(info + b"maxmemory_policy:allkeys-lru\r\n") is None
    assert memory_use_of(info) is None
    assert memory_use_of(b"used_memory:800\r\n" + kept) is None
    assert memory_use_of(b"used_memory:lots\r\nmaxmemory:1000\r\n" + kept) is None
    assert memory_use_of(b"") is None


def test_the_tiers_marks_run_from_the_high_water_mark_to_full() -> None:
    assert tier_mark("free", 0.8) == pytest.approx(0.8)
    assert tier_mark("paid", 0.8) == pytest.approx(0.8 + 0.2 / 3)
    assert tier_mark("enterprise", 0.8) == pytest.approx(0.8 + 0.4 / 3)
    assert tier_mark("enterprise", 0.8) < 1.0  # refused before Redis refuses a write
    assert tier_mark("free", 1.0) == float("inf")  # 1: off, Redis's own refusal alone


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory, own_redis: RedisServer) -> Iterator[Cluster]:
    with Cluster(
        tmp_path_factory.mktemp("memory"), own_redis.url, as_yaml(policy()), latency_ms=20
    ) as c:
        yield c


def _use(c: Cluster) -> float:
    return float(http("GET", c.urls[0] + "/readyz")[2]["redis_memory_use"])


def _set_use(c: Cluster, client: redis.Redis, target: float) -> None:
    """maxmemory set so that what Redis uses is ``target`` of it, and the
    gateway has read it."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", round(used / target))
    wait_for(lambda: abs(_use(c) - target) < 0.01, 10, f"the gateway to read {target:.2f}")


def _statuses(c: Cluster, label: str) -> dict[str, int]:
    return {tier: c.infer(tier, f"{label} {tier}")[0] for tier in ("free", "paid", "enterprise")}


def test_past_the_high_water_mark_free_is_refused_first_then_paid(cluster: Cluster) -> None:
    client = redis.Redis.from_url(cluster.redis_url)
    client.config_set("maxmemory-policy", "noeviction")
    # Some 20 MB, so that what the stack writes as it serves moves the use little.
    for i in range(200):
        client.set(f"junk:{i}", JUNK)
    assert _use(cluster) == 0.0  # no maxmemory: no mark
    assert _statuses(cluster, "unbounded") == {"free": 200, "paid": 200, "enterprise": 200}

    _set_use(cluster, client, 0.83)  # past free's mark (0.8), below paid's (0.867)
    assert _statuses(cluster, "at 0.83") == {"free": 503, "paid": 200, "enterprise": 200}
    _status, headers, body = cluster.infer("free", "refused")
    assert body["error"]["code"] == "SERVICE_OVERLOADED"
    assert "high-water mark" in body["error"]["message"]
    assert int(headers["retry-after"]) >= 1
    job = http("POST", cluster.urls[0] + "/v1/jobs", {"input": "a job"}, auth("free"))
    assert job[0] == 503
    assert "high-water mark" in job[2]["error"]["message"]
    chat = http(
        "POST",
        cluster.urls[0] + "/v1/chat/completions",
        {"model": "default", "messages": [{"role": "user", "content": "hi"}]},
        auth("free"),
    )
    assert chat[0] == 503, chat
    assert http("GET", cluster.urls[0] + "/readyz")[0] == 200  # enterprise is still served

    _set_use(cluster, client, 0.90)  # past paid's, below enterprise's (0.933)
    assert _statuses(cluster, "at 0.90") == {"free": 503, "paid": 503, "enterprise": 200}

    _set_use(cluster, client, 0.96)  # past every mark: Redis still takes writes
    assert _statuses(cluster, "at 0.96") == {"free": 503, "paid": 503, "enterprise": 503}
    client.set("still-writable", b"x")

    # A Redis that evicts (a cache's policy) never refuses a write: no mark.
    client.config_set("maxmemory-policy", "allkeys-lru")
    wait_for(lambda: _use(cluster) == 0.0, 10, "no mark while Redis evicts")
    assert _statuses(cluster, "evicting") == {"free": 200, "paid": 200, "enterprise": 200}
    client.config_set("maxmemory-policy", "noeviction")
    wait_for(lambda: _use(cluster) > 0.9, 10, "the mark back under noeviction")

    # The mark is the policy's, followed live: at 1 only Redis's own refusal is left.
    write_policy(cluster.policy_path, policy(limits={"redis_memory_high_water": 1.0}))
    wait_for(
        lambda: cluster.infer("free", "mark off")[0] == 200, 10, "the policy's new mark in force"
    )

    write_policy(cluster.policy_path, policy())
    wait_for(lambda: cluster.infer("free", "mark back")[0] == 503, 10, "the mark back at 0.8")
    client.delete(*(f"junk:{i}" for i in range(200)))
    wait_for(lambda: _use(cluster) < 0.5, 10, "the memory freed")
    assert _statuses(cluster, "freed") == {"free": 200, "paid": 200, "enterprise": 200}
    client.config_set("maxmemory", 0)
    wait_for(lambda: _use(cluster) == 0.0, 10, "no maxmemory, no mark")
    logs = cluster.gateways[0].output()
    assert logs.count('"redis.memory_high"') >= 1
    assert '"redis.memory_below_high_water"' in logs


def test_redis_filled_under_load_refuses_free_then_paid_then_enterprise_before_itself(
    cluster: Cluster,
) -> None:
    """Redis filled step by step while every tier sends: each tier's first
    refusal comes at a higher use than the tier below's, all before Redis
    refuses a write, and every request not refused is answered."""
    client = redis.Redis.from_url(cluster.redis_url)
    client.config_set("maxmemory-policy", "noeviction")
    for i in range(100):
        client.set(f"junk:{i}", JUNK)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", round(used / 0.7))
    wait_for(lambda: _use(cluster) > 0.69, 10, "the gateway to read 0.7")

    use_now = [0.7]
    first_refused: dict[str, float] = {}
    other: list[tuple[str, int]] = []
    done = threading.Event()

    def send(tier: str) -> None:
        n = 0
        while not done.is_set():
            seen = use_now[0]
            status = cluster.infer(tier, f"fill {tier} {n}")[0]
            n += 1
            if status == 503:
                first_refused.setdefault(tier, seen)
            elif status != 200:
                other.append((tier, status))

    senders = [threading.Thread(target=send, args=(t,)) for t in ("free", "paid", "enterprise")]
    for t in senders:
        t.start()
    try:
        i = 100
        while "enterprise" not in first_refused:
            assert i < 1_000, first_refused
            for _ in range(2):  # some 1.4 % a step: a few steps between two tiers' marks
                client.set(f"junk:{i}", JUNK)  # never refused: Redis is not full yet
                i += 1
            use_now[0] = wait_for(
                lambda: (u := _use(cluster)) > use_now[0] and u, 10, "the gateway's reading"
            )
            assert use_now[0] < 1.0
    finally:
        done.set()
        for t in senders:
            t.join(30)
    assert other == []
    # (what a sender saw is the reading before the one that refused it, at most)
    assert 0.78 <= first_refused["free"] < first_refused["paid"] < first_refused["enterprise"]
    assert first_refused["enterprise"] < 1.0
    client.config_set("maxmemory", 0)
    wait_for(lambda: cluster.infer("free", "after")[0] == 200, 10, "free served again")
