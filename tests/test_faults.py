"""Issue: nothing lost when things die. Real processes killed for real, on a
real Redis: the reaper, retries and dead letters, poison inputs, hangs,
cancellation, expiry, Redis outages and graceful drain."""

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
from infergate.base import clock, wire
from infergate.gpu.backends.simulated import SimulatedBackend, sim_output
from infergate.gpu.worker import Worker, WorkerSettings
from infergate.redis_server import RedisServer

from tests.helpers import (
    KEYS,
    SECRETS,
    Cluster,
    Stack,
    assert_redis_clean,
    auth,
    busy_worker,
    children_of,
    cmdline,
    http,
    policy,
    policy_yaml,
    redis_clean,
    stats,
    wait_for,
)


@pytest.fixture
def client(own_redis: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(own_redis.url)
    yield c
    c.close()


def make_worker(url: str) -> Worker:
    return Worker(
        WorkerSettings("unit-worker", url), SimulatedBackend(latency_ms=0, fail_marker="__fail__")
    )


async def test_one_poisoned_input_in_a_batch_of_100_fails_alone(own_redis: RedisServer) -> None:
    worker = make_worker(own_redis.url)
    now = clock.now_ms()
    envs = [
        wire.Envelope(
            f"r{i}", "gw", "free", "k", "bad __fail__" if i == 37 else f"in{i}", now, now + 60_000
        )
        for i in range(100)
    ]
    replies = (await worker.run_batch(wire.Batch("b", "d", now, envs))).answer().replies
    results = replies["gw"].results
    assert len(results) == 100
    failed = [r for r in results if r.error is not None]
    assert [r.id for r in failed] == ["r37"]
    assert failed[0].error is not None
    assert failed[0].error.code == "INFERENCE_FAILED"
    assert "fail marker" in failed[0].error.message
    for r, env in zip(results, envs, strict=True):
        if r.id != "r37":
            assert r.output == sim_output(env.input)
    await worker.store.close()


def test_poisoned_request_gets_500_and_its_neighbours_succeed(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=1, latency_ms=50)
    try:

        async def burst() -> list[tuple[int, dict]]:
            async with aiohttp.ClientSession() as s:

                async def one(text: str) -> tuple[int, dict]:
                    async with s.post(
                        c.urls[0] + "/v1/inference",
                        json={"input": text},
                        headers={"Authorization": "Bearer " + SECRETS["paid"]},
                    ) as r:
                        return r.status, await r.json()

                return await asyncio.gather(
                    *(one("x __fail__" if i == 5 else f"n{i}") for i in range(30))
                )

        results = asyncio.run(burst())
        assert [s for s, _ in results].count(200) == 29
        status, body = results[5]
        assert status == 500
        assert body["error"]["code"] == "INFERENCE_FAILED"
        assert max(b.get("batch_size", 0) for _, b in results) > 1
    finally:
        c.stop()


def test_hung_worker_exits_and_the_batch_is_retried_then_dead_lettered(
    tmp_path: Path, own_redis: RedisServer, client: redis.Redis
) -> None:
    # The policy's defaults (no `workers:` section): the documented 500 must be
    # reachable before the paid tier's 10 s deadline, not end in a 504.
    assert "workers" not in policy()
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=3, latency_ms=20)
    try:
        status, _, body = c.infer("paid", "stuck __hang__")
        assert status == 500, body
        assert body["error"]["code"] == "INFERENCE_FAILED"
        assert "failed 2 times" in body["error"]["message"]
        # Two workers hung on it, in turn, and left with the hang exit code.
        exited = wait_for(
            lambda: (
                [w for w in c.workers if not w.alive()]
                if sum(not w.alive() for w in c.workers) >= 2
                else None
            ),
            5,
            "two workers to exit",
        )
        assert [w.proc.returncode for w in exited] == [3, 3]
        s = stats(client)
        assert s["batches_retried"] == 1
        assert s["batches_dead_lettered"] == 1
        assert client.llen(KEYS.dead_letter) == 1
        assert c.infer("paid", "fine")[0] == 200  # the surviving worker still serves

        # An operator lists the dead letters: sizes, tiers and why, never the input.
        url = c.urls[0] + "/v1/admin/dead-letters"
        assert http("GET", url, headers=auth("paid"))[0] == 403
        status, _, listing = http("GET", url, headers=auth("admin"))
        assert status == 200, listing
        assert listing["total"] == 1
        (letter,) = listing["batches"]
        assert letter["runs"] == 2
        assert letter["requests"] == 1
        assert letter["tiers"] == {"paid": 1}
        assert letter["input_chars"] == [len("stuck __hang__")]
        assert "died or hung" in letter["error"]
        assert "__hang__" not in json.dumps(listing)
        assert http("GET", url + "?limit=0", headers=auth("admin"))[0] == 400
        status, _, purged = http("DELETE", url, headers=auth("admin"))
        assert (status, purged) == (200, {"purged": 1})
        assert client.llen(KEYS.dead_letter) == 0
    finally:
        c.stop()


def test_a_killed_worker_mid_batch_loses_nothing(
    tmp_path: Path, own_redis: RedisServer, client: redis.Redis
) -> None:
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=1, latency_ms=1500)
    try:
        spare = None

        async def run() -> tuple[int, dict]:
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    c.urls[0] + "/v1/inference",
                    json={"input": "survivor"},
                    headers={"Authorization": "Bearer " + SECRETS["paid"]},
                ) as r,
            ):
                return r.status, await r.json()

        async def scenario() -> tuple[int, dict]:
            nonlocal spare
            task = asyncio.create_task(run())
            await asyncio.to_thread(
                wait_for,
                lambda: busy_worker(client) is not None,
                5,
                "the batch to be processing",
            )
            c.kill_worker()  # SIGKILL mid-batch
            spare = c.add_worker()
            return await task

        status, body = asyncio.run(scenario())
        assert status == 200
        assert body["output"] == sim_output("survivor")
        assert stats(client)["batches_retried"] == 1
        wait_for(
            lambda: (
                not any(client.scan_iter(KEYS.prefix + "processing:*"))
                or all(client.llen(k) == 0 for k in client.scan_iter(KEYS.prefix + "processing:*"))
            ),
            5,
            "processing to empty",
        )
    finally:
        c.stop()


def test_a_dead_dispatchers_inflight_goes_back_to_the_front(
    tmp_path: Path, own_redis: RedisServer, client: redis.Redis
) -> None:
    # A dispatcher that died holding envelopes: its inflight list and its
    # membership remain, its heartbeat is gone.
    now = clock.now_ms()
    ghost = "dispatcher-ghost"
    for i in range(3):
        env = wire.Envelope(f"ghost-{i}", "gw-gone", "free", "k", f"g{i}", now, now + 60_000)
        client.rpush(KEYS.inflight(ghost), wire.encode(env))
    client.sadd(KEYS.members("dispatcher"), ghost)
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=1, latency_ms=10)
    try:
        wait_for(lambda: client.llen(KEYS.inflight(ghost)) == 0, 5, "the reaper to requeue")
        wait_for(
            lambda: stats(client).get("requests_batched", 0) >= 3,
            5,
            "the requeued envelopes to run",
        )
        assert not client.sismember(KEYS.members("dispatcher"), ghost)
        assert stats(client)["requeued"] == 3
        assert c.infer("free", "after")[0] == 200
    finally:
        c.stop()


def test_cancelled_and_expired_requests_never_reach_a_worker(
    tmp_path: Path, own_redis: RedisServer, client: redis.Redis
) -> None:
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=1, latency_ms=1000)
    try:

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                hdrs = {"Authorization": "Bearer " + SECRETS["paid"]}
                busy = asyncio.create_task(
                    s.post(
                        c.urls[0] + "/v1/inference",
                        json={"input": "occupies the worker"},
                        headers=hdrs,
                    )
                )
                await asyncio.to_thread(
                    wait_for, lambda: busy_worker(client) is not None, 5, "the worker to be busy"
                )
                # The client gives up after 200 ms and closes its connection.
                with pytest.raises(TimeoutError):
                    async with s.post(
                        c.urls[0] + "/v1/inference",
                        json={"input": "abandoned"},
                        headers=hdrs,
                        timeout=aiohttp.ClientTimeout(total=0.2),
                    ):
                        pass
                # This one's own deadline passes while it is queued.
                async with s.post(
                    c.urls[0] + "/v1/inference",
                    json={"input": "expires", "timeout_ms": 300},
                    headers=hdrs,
                ) as r:
                    assert r.status == 504
                resp = await busy
                assert resp.status == 200
                resp.release()

        asyncio.run(scenario())
        wait_for(
            lambda: (
                stats(client).get("cancelled_dropped", 0) == 1
                and stats(client).get("expired_dropped", 0) == 1
            ),
            5,
            "both to be dropped at take",
        )
        # A last request goes through take after the dropped ones: once it is
        # answered, every batch there will be has been formed.
        assert c.infer("paid", "barrier")[0] == 200
        assert stats(client)["requests_batched"] == 2  # the dropped two never reached a worker
    finally:
        c.stop()


def test_redis_outage_fails_fast_then_recovers(tmp_path: Path, own_redis: RedisServer) -> None:
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=1, latency_ms=20)
    try:
        assert c.infer("paid", "before")[0] == 200
        own_redis.kill()

        def refused_fast() -> bool:
            started = time.monotonic()
            status, _, body = c.infer("paid", "during")
            assert time.monotonic() - started < 3.0
            return status == 503 and body["error"]["code"] == "SERVICE_OVERLOADED"

        wait_for(refused_fast, 5, "503 while Redis is down")
        assert http("GET", c.urls[0] + "/readyz")[0] == 503
        own_redis.start()
        wait_for(
            lambda: http("GET", c.urls[0] + "/readyz")[0] == 200,
            15,
            "readiness after Redis is back",
        )
        wait_for(lambda: c.infer("paid", "after")[0] == 200, 10, "service after Redis is back")
    finally:
        c.stop()


# SIGHUP (a terminal closed) drains as SIGTERM does; before, it ended each
# process at once, the gateway's held requests with it.
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_sigterm_drains_gateway_worker_and_dispatcher(
    tmp_path: Path, own_redis: RedisServer, client: redis.Redis, signum: int
) -> None:
    if signum == signal.SIGHUP and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        pytest.skip("run under nohup: its processes ignore SIGHUP, as they should")
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=1, latency_ms=1000)
    gateway, dispatcher, worker = c.gateways[0], c.dispatchers[0], c.workers[0]
    try:

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                hdrs = {"Authorization": "Bearer " + SECRETS["paid"]}
                held = asyncio.create_task(
                    s.post(c.urls[0] + "/v1/inference", json={"input": "held"}, headers=hdrs)
                )
                await asyncio.to_thread(
                    wait_for, lambda: busy_worker(client) is not None, 5, "the batch to start"
                )
                worker.signal(signum)
                # Draining at once: still finishing its batch, no longer capacity.
                # (The status reads the heartbeats now; admission's capacity is
                # the gateway's view, at most one refresh behind.)
                drained = await asyncio.to_thread(
                    wait_for,
                    lambda: (
                        (st := c.status())["workers"][0]["draining"]
                        and st["capacity_rps"] == 0
                        and st
                    ),
                    5,
                    "the worker to report draining, and admission to stop counting it",
                )
                assert drained["workers"][0]["busy"]
                gateway.signal(signum)
                dispatcher.signal(signum)
                await asyncio.to_thread(
                    wait_for,
                    lambda: http("GET", c.urls[0] + "/readyz")[0] == 503,
                    5,
                    "the gateway to start draining",
                )
                async with aiohttp.ClientSession() as fresh:
                    async with fresh.post(
                        c.urls[0] + "/v1/inference", json={"input": "late"}, headers=hdrs
                    ) as r:
                        assert r.status == 503
                        assert (await r.json())["error"]["code"] == "SERVICE_OVERLOADED"
                    async with fresh.get(c.urls[0] + "/readyz") as r:
                        assert r.status == 503
                resp = await held
                assert resp.status == 200
                assert (await resp.json())["output"] == sim_output("held")

        asyncio.run(scenario())
        for p in (gateway, worker, dispatcher):
            assert p.wait(15) == 0, p.output()[-2000:]
        assert client.llen(KEYS.ready) == 0  # the worker withdrew its credit
        assert_redis_clean(client)
    finally:
        c.stop()


def test_rolling_restart_of_workers_and_dispatchers_under_load_loses_nothing(
    tmp_path: Path, own_redis: RedisServer, client: redis.Redis
) -> None:
    c = Cluster(tmp_path, own_redis.url, policy_yaml(), workers=2, dispatchers=2, latency_ms=100)
    try:

        async def load() -> list[int]:
            async with aiohttp.ClientSession() as s:
                hdrs = {"Authorization": "Bearer " + SECRETS["paid"]}

                async def one(i: int) -> int:
                    async with s.post(
                        c.urls[0] + "/v1/inference", json={"input": f"roll-{i}"}, headers=hdrs
                    ) as r:
                        body = await r.json()
                        if r.status == 200:
                            assert body["output"] == sim_output(f"roll-{i}")
                        return r.status

                tasks = []
                start = time.monotonic()
                for i in range(800):  # 100 req/s for 8 s
                    await asyncio.sleep(max(0.0, start + i / 100 - time.monotonic()))
                    tasks.append(asyncio.create_task(one(i)))
                return await asyncio.gather(*tasks)

        def serving_workers() -> int:
            return sum(not w["draining"] for w in c.status()["workers"])

        def roll() -> None:
            # As a rollout does it: one process at a time, the next stopped
            # only once its replacement is up (a worker is ready when the
            # fleet counts it; with none, a request would get 503 at once).
            for old in [*c.workers, *c.dispatchers]:
                time.sleep(1.0)  # pacing: one restart a second, while the load runs
                old.signal(signal.SIGTERM)
                assert old.wait(15) == 0
                if old in c.workers:
                    c.add_worker()
                    wait_for(lambda: serving_workers() == 2, 20, "the new worker to serve")
                else:
                    new = c._start(["dispatcher", "--policy", str(c.policy_path)], "dispatcher-new")
                    c.procs.append(new)
                    wait_for(lambda: c.status()["dispatchers_alive"] == 2, 20, "the dispatcher")

        async def scenario() -> list[int]:
            roller = asyncio.create_task(asyncio.to_thread(roll))
            statuses = await load()
            await roller
            return statuses

        statuses = asyncio.run(scenario())
        assert statuses == [200] * 800
        wait_for(lambda: redis_clean(client), 10, "Redis to drain")
    finally:
        c.stop()


def test_up_restarts_a_worker_that_dies(tmp_path: Path, own_redis: RedisServer) -> None:
    s = Stack(tmp_path, own_redis.url, workers=2, policy=policy_yaml())
    try:
        workers = [p for p in children_of(s.proc.proc.pid) if "infergate worker" in cmdline(p)]
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)

        def replaced() -> bool:
            now = [p for p in children_of(s.proc.proc.pid) if "infergate worker" in cmdline(p)]
            return len(now) == 2 and workers[0] not in now

        wait_for(replaced, 10, "up to start a new worker")
        assert "up.child_restarted" in s.proc.output()
        wait_for(
            lambda: (
                http("GET", s.url + "/v1/status", headers=auth("admin"))[2]["workers_alive"] == 2
            ),
            10,
            "two live workers",
        )
        assert s.infer("paid", "after restart")[0] == 200
    finally:
        s.stop()
