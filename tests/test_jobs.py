"""Asynchronous jobs over real processes: submit, long-poll, fetch, cancel,
expiry, another key's 404, a gateway killed after the submit, a worker killed
mid-batch with jobs in it, and the bound on jobs queued per key."""

import time
from pathlib import Path
from typing import Any

import redis
from infergate.gpu.backends.simulated import sim_output

from tests.helpers import (
    KEYS,
    SECRETS,
    Cluster,
    assert_redis_clean,
    auth,
    busy_worker,
    http,
    policy_yaml,
    redis_clean,
    stats,
    wait_for,
)


def submit(c: Cluster, text: str, tier: str = "paid", i: int = 0, **extra: Any) -> Any:
    return http("POST", c.urls[i] + "/v1/jobs", {"input": text, **extra}, auth(tier))


def fetch(c: Cluster, job_id: str, tier: str = "paid", i: int = 0, wait_s: float = 0) -> Any:
    url = f"{c.urls[i]}/v1/jobs/{job_id}" + (f"?wait_s={wait_s}" if wait_s else "")
    return http("GET", url, headers=auth(tier))


def test_a_job_from_submit_to_result_seen_only_by_its_key(tmp_path: Path, redis_url: str) -> None:
    with Cluster(tmp_path, redis_url, policy_yaml(), workers=1) as c:
        status, headers, body = submit(c, "a job")
        assert status == 202, body
        job_id = body["job_id"]
        assert body["status"] == "queued"
        assert headers["location"] == body["location"] == f"/v1/jobs/{job_id}"
        assert "x-request-id" in headers

        started = time.monotonic()
        status, _, view = fetch(c, job_id, wait_s=10)
        assert time.monotonic() - started < 5  # the long poll ended when the job did
        assert status == 200, view
        assert view["status"] == "succeeded"
        assert view["result"]["output"] == sim_output("a job")
        assert view["result"]["request_id"] == job_id
        assert view["result"]["tier"] == "paid"
        assert view["done_ms"] >= view["created_ms"]

        # Another key, an unknown id and a malformed one read the same: 404.
        for tier, some_id in (("free", job_id), ("paid", "0" * 32), ("paid", "../x")):
            status, _, body = fetch(c, some_id, tier=tier)
            assert status == 404, body
            assert body["error"]["code"] == "NOT_FOUND"
        assert http("GET", f"{c.urls[0]}/v1/jobs/{job_id}")[0] == 401
        # A finished job cannot be cancelled.
        status, _, body = http("DELETE", f"{c.urls[0]}/v1/jobs/{job_id}", headers=auth("paid"))
        assert status == 409, body
        assert body["error"]["code"] == "CONFLICT"
        client = redis.Redis.from_url(redis_url)
        wait_for(lambda: redis_clean(client), 10, "the lists to empty")
        assert client.hlen(KEYS.jobs_queued) == 0


def test_cancel_and_expiry_while_no_worker_runs_jobs(tmp_path: Path, redis_url: str) -> None:
    doc = policy_yaml(jobs={"result_ttl_s": 2})
    c = Cluster(tmp_path, redis_url, doc, workers=1)
    client = redis.Redis.from_url(redis_url)
    try:
        c.stop_workers()
        cancelled = submit(c, "cancel me")[2]["job_id"]
        expiring = submit(c, "too late", timeout_ms=1500)[2]["job_id"]
        assert fetch(c, cancelled)[2]["status"] == "queued"
        status, _, body = http("DELETE", f"{c.urls[0]}/v1/jobs/{cancelled}", headers=auth("free"))
        assert status == 404  # not this key's job
        assert client.hget(KEYS.jobs_queued, "pai") == b"2"
        for _ in range(2):  # cancelling again changes nothing
            status, _, body = http(
                "DELETE", f"{c.urls[0]}/v1/jobs/{cancelled}", headers=auth("paid")
            )
            assert (status, body["status"]) == (200, "cancelled"), body
        assert client.hget(KEYS.jobs_queued, "pai") == b"1"  # it stopped counting at once
        wait_for(lambda: fetch(c, expiring)[2]["status"] == "expired", 10, "the job to expire")
        status, _, body = http("DELETE", f"{c.urls[0]}/v1/jobs/{expiring}", headers=auth("paid"))
        assert status == 409, body
        assert "expired" in body["error"]["message"]

        c.add_worker()  # neither runs: take drops them
        wait_for(
            lambda: (
                stats(client).get("cancelled_dropped", 0) == 1
                and stats(client).get("expired_dropped", 0) == 1
            ),
            15,
            "the dispatcher to drop both",
        )
        assert fetch(c, cancelled)[2]["status"] == "cancelled"
        assert fetch(c, expiring)[2]["status"] == "expired"
        # A finished job is kept for jobs.result_ttl_s, then gone.
        done = submit(c, "short-lived")[2]["job_id"]
        assert fetch(c, done, wait_s=10)[2]["status"] == "succeeded"
        wait_for(lambda: fetch(c, done)[0] == 404, 10, "the result to expire")
        assert_redis_clean(client)
    finally:
        c.stop()


def test_a_gateway_killed_after_the_submit_changes_nothing(tmp_path: Path, redis_url: str) -> None:
    with Cluster(tmp_path, redis_url, policy_yaml(), gateways=2, workers=1, latency_ms=300) as c:
        ids = [submit(c, f"survives {i}", i=0)[2]["job_id"] for i in range(5)]
        c.kill(c.gateways[0])
        for i, job_id in enumerate(ids):
            status, _, view = fetch(c, job_id, i=1, wait_s=15)
            assert (status, view["status"]) == (200, "succeeded"), view
            assert view["result"]["output"] == sim_output(f"survives {i}")


def test_a_worker_killed_mid_batch_with_jobs_in_it(tmp_path: Path, redis_url: str) -> None:
    c = Cluster(tmp_path, redis_url, policy_yaml(), workers=2, latency_ms=1500)
    client = redis.Redis.from_url(redis_url)
    try:
        ids = [submit(c, f"mid-batch {i}")[2]["job_id"] for i in range(3)]
        victim = wait_for(lambda: busy_worker(client), 10, "a worker to start the jobs")
        assert fetch(c, ids[0])[2]["status"] == "running"
        c.kill(next(w for w in c.workers if victim in w.output()))
        for i, job_id in enumerate(ids):
            status, _, view = fetch(c, job_id, wait_s=20)
            assert (status, view["status"]) == (200, "succeeded"), view
            assert view["result"]["output"] == sim_output(f"mid-batch {i}")
        assert stats(client).get("batches_retried", 0) >= 1
    finally:
        c.stop()


def test_a_key_with_too_many_queued_jobs_gets_429_and_keeps_its_quota(
    tmp_path: Path, redis_url: str
) -> None:
    doc = policy_yaml(jobs={"max_queued_per_key": 2}, tiers={"free": {"rate_limits": ["3/minute"]}})
    with Cluster(tmp_path, redis_url, doc, workers=1) as c:
        c.stop_workers()
        assert [submit(c, f"j{i}", tier="free")[0] for i in range(2)] == [202, 202]
        status, headers, body = submit(c, "one too many", tier="free")
        assert status == 429, body
        assert "jobs.max_queued_per_key" in body["error"]["message"]
        assert int(headers["retry-after"]) >= 1
        # The refused job was refunded: the third of three per minute is still there.
        c.add_worker()
        wait_for(lambda: submit(c, "now fits", tier="free")[0] == 202, 15, "a free slot")
        assert submit(c, "over quota", tier="free")[0] == 429


def test_job_requests_that_are_not_the_schema_are_400(tmp_path: Path, redis_url: str) -> None:
    with Cluster(tmp_path, redis_url, policy_yaml(), workers=1) as c:
        for raw in (b"", b"{", b'{"input": 5}', b'{"input": ""}', b'{"input": "x", "extra": 1}'):
            status, _, body = http("POST", c.urls[0] + "/v1/jobs", raw=raw, headers=auth("paid"))
            assert status == 400, (raw, body)
        assert submit(c, "x", tier="disabled")[0] == 403
        status, _, body = fetch(c, "a" * 32, wait_s=-1)
        assert status == 400, body
        assert http("POST", c.urls[0] + "/v1/jobs", {"input": "x"})[0] == 401
        assert SECRETS["paid"] not in str(body)


def test_a_job_cancelled_then_dropped_past_its_deadline_stays_cancelled(
    tmp_path: Path, redis_url: str
) -> None:
    """Cancelling counted it out of its key's queued jobs already: the take
    that drops it later, past its deadline, neither counts it out again
    (which let a key queue more than max_queued_per_key) nor calls it
    expired."""
    c = Cluster(tmp_path, redis_url, policy_yaml(), workers=1)
    client = redis.Redis.from_url(redis_url)
    try:
        c.stop_workers()
        job_id = submit(c, "cancel me, then expire", timeout_ms=800)[2]["job_id"]
        status, _, body = http("DELETE", f"{c.urls[0]}/v1/jobs/{job_id}", headers=auth("paid"))
        assert (status, body["status"]) == (200, "cancelled"), body
        deadline_ms = int(client.hget(KEYS.job(job_id), "deadline_ms") or 0)
        wait_for(lambda: redis_ms(client) > deadline_ms, 5, "its deadline on Redis's clock")
        c.add_worker()
        wait_for(lambda: stats(client).get("expired_dropped", 0) == 1, 15, "the take to drop it")
        assert fetch(c, job_id)[2]["status"] == "cancelled"
        assert client.hget(KEYS.jobs_queued, "pai") is None
    finally:
        client.close()
        c.stop()


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000
