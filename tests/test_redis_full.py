"""Redis out of memory (``maxmemory`` reached, ``noeviction``) is its own
state: readiness says so, new work is refused with a 503 that says what
happened, a request already running is answered on time, no live worker is
declared dead for failing to write its heartbeat, a final job status never
changes, the logs say it once rather than once a request or a beat, and all
of it ends when memory frees. A real stack on a real Redis, filled by the
test until it refuses writes."""

import concurrent.futures
import json
import time
from collections.abc import Iterator

import pytest
import redis
from infergate.base.keys import Keys
from infergate.redis_server import RedisServer

from tests.helpers import Cluster, as_yaml, auth, http, policy, wait_for

LATENCY_MS = 800  # a batch runs long enough for memory to run out under it
JUNK = b"j" * 100_000


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory, own_redis: RedisServer) -> Iterator[Cluster]:
    with Cluster(
        tmp_path_factory.mktemp("full"),
        own_redis.url,
        as_yaml(policy()),
        workers=2,
        latency_ms=LATENCY_MS,
    ) as c:
        yield c


def _fill(client: redis.Redis) -> int:
    """Set maxmemory just above what is used, then write junk until Redis
    refuses: returns how many junk keys went in."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", used + 2_000_000)
    for i in range(1_000):
        try:
            client.set(f"junk:{i}", JUNK)
        except redis.exceptions.OutOfMemoryError:
            # Well over, so that what the stack frees as it answers (a few
            # KB) does not bring it back under.
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", used - 1_000_000)
            return i
    raise AssertionError("Redis never ran out of memory")


def _free(client: redis.Redis, junk: int) -> None:
    client.delete(*(f"junk:{i}" for i in range(junk + 1)))
    client.config_set("maxmemory", 0)


def _readiness(c: Cluster) -> tuple[int, dict]:
    status, _, body = http("GET", c.urls[0] + "/readyz")
    return status, body


def _lines(c: Cluster) -> dict[str, int]:
    return {p.log_path.name: len(p.output().splitlines()) for p in c.procs + c.workers}


def test_redis_out_of_memory_refuses_new_work_and_loses_nothing(cluster: Cluster) -> None:
    client = redis.Redis.from_url(cluster.redis_url)
    keys = Keys("infergate")
    status, _, job = http(
        "POST", cluster.urls[0] + "/v1/jobs", {"input": "done before"}, auth("paid")
    )
    assert status == 202
    job_url = f"{cluster.urls[0]}/v1/jobs/{job['job_id']}"
    finished = wait_for(
        lambda: (
            (v := http("GET", job_url + "?wait_s=5", headers=auth("paid"))[2])["status"]
            == "succeeded"
            and v
        ),
        30,
        "the job to finish",
    )
    workers = {w.decode() for w in client.smembers(keys.members("worker"))}
    assert len(workers) == 2

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # A request already running when memory runs out...
        running = pool.submit(lambda: (time.monotonic(), cluster.infer("enterprise", "in flight")))
        wait_for(
            lambda: client.llen(keys.batches) == 0 and _busy(client, keys), 10, "a batch to run"
        )
        junk = _fill(client)
        started, (status, _, body) = running.result(timeout=30)
        # ...is answered when its batch ends, not at its deadline (10 s).
        assert status == 200, body
        assert body["output"].endswith("in flight")
        assert time.monotonic() - started < LATENCY_MS / 1000 + 3

    try:
        ready = wait_for(
            lambda: (r := _readiness(cluster))[0] == 503 and r[1]["redis_full"] and r,
            5,
            "not ready",
        )
        assert ready[1]["redis_ok"] is True  # reachable: full, not gone
        lines_before = _lines(cluster)
        for _ in range(5):
            status, headers, body = cluster.infer("paid", "refused")
            assert status == 503, body
            assert body["error"]["code"] == "SERVICE_OVERLOADED"
            assert "out of memory" in body["error"]["message"]
            assert int(headers["retry-after"]) >= 1
        status, _, body = http("POST", cluster.urls[0] + "/v1/jobs", {"input": "x"}, auth("paid"))
        assert status == 503
        assert "out of memory" in body["error"]["message"]
        # Heartbeats cannot be written: every worker's key lives on, past 3
        # TTLs after the last beat Redis took (its beat_ms, on Redis's clock).
        wait_for(
            lambda: all(_alive_on_old_beat(client, keys, w) for w in workers),
            10,
            "every worker alive 3 TTLs after its last written beat",
        )
        # The same job reads the same, final.
        assert http("GET", job_url, headers=auth("paid"))[2] == finished
        grown = {
            name: n - lines_before[name]
            for name, n in _lines(cluster).items()
            if name in lines_before
        }
        assert max(grown.values()) < 15, grown  # no line per beat or per request
    finally:
        _free(client, junk)

    wait_for(lambda: _readiness(cluster)[0] == 200, 10, "ready again")
    # (the memory's high-water mark, read every 0.2 s while past it, frees too)
    wait_for(lambda: cluster.infer("paid", "after")[0] == 200, 2, "new work taken again")
    assert http("GET", job_url, headers=auth("paid"))[2] == finished
    assert client.llen(keys.dead_letter) == 0
    for proc in cluster.procs + cluster.workers:
        log = proc.output()
        assert "Traceback" not in log, proc.log_path.name
        assert "worker_dead" not in log, proc.log_path.name
        assert "batch_retried" not in log, proc.log_path.name
    gateway_log = cluster.gateways[0].output()
    assert sum('"redis.out_of_memory"' in line for line in gateway_log.splitlines()) == 1


def _busy(client: redis.Redis, keys: Keys) -> bool:
    return any(client.llen(k) for k in client.scan_iter(keys.processing("*")))


def _alive_on_old_beat(client: redis.Redis, keys: Keys, worker: str) -> bool:
    """The worker's heartbeat key is there, and the beat it holds was
    written more than 3 TTLs (3 s) ago: it was kept alive without a write."""
    raw = client.get(keys.heartbeat("worker", worker))
    assert raw is not None, f"{worker} was declared dead"
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000 - json.loads(raw)["beat_ms"] > 3_000
