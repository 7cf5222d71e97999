"""Chaos under steady load: SIGKILL a worker mid-batch, SIGKILL a dispatcher,
SIGKILL a gateway, restart Redis; every request accepted by a surviving
gateway ends in 200 or an explicit error, none waits past its deadline, each
200 carries its own output, and Redis is clean afterwards."""

import asyncio
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
import redis
from infergate.gpu.backends.simulated import sim_output
from infergate.redis_server import RedisServer

from tests.helpers import SECRETS, Cluster, assert_redis_clean, policy_yaml, redis_clean, wait_for

DEADLINE_MS = 3_000
RATE = 200
DURATION_S = 12.0


async def drive(c: Cluster, events: dict[float, object]) -> list[dict]:
    records: list[dict] = []
    hdrs = {"Authorization": "Bearer " + SECRETS["paid"]}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1000), timeout=aiohttp.ClientTimeout(total=15)
    ) as session:

        async def one(i: int, gw: int) -> None:
            text = f"chaos-{i}"
            rec: dict = {"i": i, "gw": gw, "text": text, "sent": time.monotonic()}
            try:
                async with session.post(
                    c.urls[gw] + "/v1/inference", json={"input": text}, headers=hdrs
                ) as r:
                    rec["status"] = r.status
                    rec["body"] = await r.json()
            except (aiohttp.ClientError, TimeoutError) as exc:
                rec["status"] = None
                rec["error"] = type(exc).__name__
            rec["took"] = time.monotonic() - rec["sent"]
            records.append(rec)

        start = time.monotonic()
        tasks = []
        pending = sorted(events.items())
        for i in range(int(RATE * DURATION_S)):
            due = start + i / RATE
            while pending and due - start >= pending[0][0]:
                _, action = pending.pop(0)
                await asyncio.to_thread(action)  # type: ignore[arg-type]
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(one(i, i % 2)))
        await asyncio.gather(*tasks)
    return records


# The stack runs in processes of its own: a socket left unclosed in this one
# is the test client's (aiohttp's connect cut off as a gateway is killed).
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"
)
def test_chaos_loses_nothing(tmp_path: Path, own_redis: RedisServer) -> None:
    server = own_redis
    policy = policy_yaml(deadline_ms=DEADLINE_MS)
    c = Cluster(tmp_path, server.url, policy, gateways=2, workers=3, dispatchers=2, latency_ms=100)
    client = redis.Redis.from_url(server.url)
    timeline: dict[str, float] = {}

    def mark(name: str, action) -> callable:
        def run() -> None:
            timeline[name] = time.monotonic()
            action()

        return run

    def kill_worker() -> None:
        c.kill_worker()
        c.add_worker()

    def restart_redis() -> None:
        server.kill()
        time.sleep(0.5)  # pacing: Redis stays down this long
        server.start()

    try:
        events = {
            2.0: mark("worker", kill_worker),
            4.0: mark("dispatcher", lambda: c.kill(c.dispatchers[0])),
            6.0: mark("gateway", lambda: c.kill(c.gateways[1])),
            8.0: mark("redis", restart_redis),
        }
        records = asyncio.run(drive(c, events))
        survivor = [r for r in records if r["gw"] == 0]
        explicit = {200, 500, 503, 504}
        by_status = Counter(r["status"] for r in survivor)
        # Every request to the surviving gateway got an explicit answer...
        assert set(by_status) <= explicit, by_status
        # ...none later than its deadline (plus scheduling slack on 2 cores)...
        assert max(r["took"] for r in survivor) < DEADLINE_MS / 1000 + 1.0
        # ...and every success carries its own request's output.
        for r in records:
            if r["status"] == 200:
                assert r["body"]["output"] == sim_output(r["text"])
        assert by_status[200] >= 0.8 * len(survivor), by_status
        # Requests to the killed gateway after its death found nothing to talk to.
        after = [r for r in records if r["gw"] == 1 and r["sent"] > timeline["gateway"] + 0.1]
        assert after
        assert all(r["status"] is None for r in after)
        # A reply the surviving gateway ignored is either a duplicate from the one
        # batch that ran twice (the killed worker's: at most 100 requests) or one
        # that came after its request had been answered with an error: anything
        # more would be replies delivered to the wrong gateway or counted twice.
        ignored = c.status()["replies_ignored"]
        assert ignored <= len(survivor) - by_status[200] + 100, (ignored, by_status)
        # Once the load stops the fleet drains and Redis holds nothing of it.
        wait_for(lambda: c.status()["workers_alive"] == 3, 10, "the workers to be back")
        try:
            wait_for(lambda: redis_clean(client), 10, "Redis to drain")
        except AssertionError:
            assert_redis_clean(client)  # fails, saying what is left
    finally:
        client.close()
        c.stop()
