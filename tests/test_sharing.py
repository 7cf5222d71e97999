"""Work done once: identical requests collapse into one backend slot, and a
recent answer is served from the cache, over real processes."""

import asyncio
import re
from pathlib import Path

import aiohttp
from infergate.base.keys import Keys
from infergate.base.ports import free_port
from infergate.base.queue.gateway import GatewayQueue
from infergate.base.queue.store import Store
from infergate.gateway.sharing import Cache
from infergate.gpu.backends.simulated import sim_output

from tests.helpers import SECRETS, Cluster, auth, http, policy_yaml


def scraped(port: int, name: str) -> float:
    body = http("GET", f"http://127.0.0.1:{port}/metrics")[2]
    text = body.decode() if isinstance(body, bytes) else str(body)
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def identical_burst(url: str, text: str, n: int) -> list[tuple[int, dict]]:
    tiers = ["paid", "free", "enterprise"]
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> tuple[int, dict]:
            headers = {"Authorization": "Bearer " + SECRETS[tiers[i % 3]]}
            async with session.post(url, json={"input": text}, headers=headers) as r:
                return r.status, await r.json()

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_200_identical_requests_from_three_keys_take_a_handful_of_slots(
    tmp_path: Path, redis_url: str
) -> None:
    doc = policy_yaml(tiers={t: {"rate_limits": ["1000/minute"]} for t in ("free", "paid")})
    with Cluster(tmp_path, redis_url, doc, workers=2, metrics=True) as c:
        worker_ports = [
            p for name, p in (c.metrics_ports or {}).items() if name.startswith("worker")
        ]
        results = asyncio.run(identical_burst(c.urls[0] + "/v1/inference", "trending prompt", 200))
        assert {status for status, _ in results} == {200}
        assert len({body["request_id"] for _, body in results}) == 200  # each its own id
        assert all(body["output"] == sim_output("trending prompt") for _, body in results)
        served = [body["served_by"] for _, body in results]
        backend_inputs = sum(scraped(p, "infergate_backend_inputs_total") for p in worker_ports)
        print(f"\n200 identical requests: {backend_inputs:.0f} backend inputs; {served.count('model')} model, {served.count('collapsed')} collapsed")  # fmt: skip
        assert backend_inputs <= 10, backend_inputs  # a handful, not 200 (warm-ups not counted)
        # Each key's first request leads at the gateway; the rest wait for it.
        assert served.count("collapsed") >= 150, served


def test_a_cached_answer_comes_back_in_milliseconds_and_costs_quota(
    tmp_path: Path, redis_url: str
) -> None:
    doc = policy_yaml(
        sharing={"scope": "tier", "cache_ttl_s": 30},
        tiers={"paid": {"rate_limits": ["10/minute"]}},
    )
    with Cluster(tmp_path, redis_url, doc, workers=1) as c:
        status, headers, first = c.infer("paid", "same question")
        assert (status, first["served_by"]) == (200, "model")
        remaining = int(headers["x-ratelimit-remaining-requests"])
        status, headers, again = c.infer("paid", "same question")
        assert (status, again["served_by"]) == (200, "cache"), again
        assert again["output"] == first["output"]
        assert again["request_id"] != first["request_id"]
        assert again["latency_ms"] < 50  # no queue, no batch: one Redis read
        assert int(headers["x-ratelimit-remaining-requests"]) == remaining - 1
        # The scope is the tier: another tier's key does not see it.
        status, _, other = c.infer("free", "same question")
        assert (status, other["served_by"]) == (200, "model")


async def test_the_cache_is_bypassed_when_redis_fails() -> None:
    store = Store.connect(f"redis://127.0.0.1:{free_port()}/0", "t", name="test")
    errors: list[int] = []
    try:
        cache = Cache(GatewayQueue(store, "gw"), lambda: errors.append(1))
        assert await cache.get("digest", "simulated/1") is None
        assert errors == [1]
    finally:
        await store.close()


def test_a_follower_whose_leader_gives_up_runs_on_its_own(tmp_path: Path, redis_url: str) -> None:
    """Collapsing never makes a request fail for another's reason: the
    leader's short deadline passes, the follower still gets its answer."""
    c = Cluster(tmp_path, redis_url, policy_yaml(), workers=1, latency_ms=400)

    async def both() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession() as session:

            async def one(extra: dict, delay_s: float) -> tuple[int, dict]:
                await asyncio.sleep(delay_s)  # pacing: the leader is in flight first
                async with session.post(
                    c.urls[0] + "/v1/inference",
                    json={"input": "shared", **extra},
                    headers=auth("paid"),
                ) as r:
                    return r.status, await r.json()

            return await asyncio.gather(one({"timeout_ms": 100}, 0), one({}, 0.02))

    try:
        (leader_status, _), (status, body) = asyncio.run(both())
        assert leader_status == 504
        assert status == 200, body
        assert body["output"] == sim_output("shared")
    finally:
        c.stop()


def test_keys_module_builds_cache_keys_under_the_hash_tag() -> None:
    key = Keys("ns").cache("d" * 64, "simulated/1")
    assert key.startswith("{ns}:cache:")


def test_identical_inputs_that_fail_fail_alike_and_nothing_else(
    tmp_path: Path, redis_url: str
) -> None:
    c = Cluster(tmp_path, redis_url, policy_yaml(), workers=1, latency_ms=200)

    async def burst() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession() as session:

            async def one(text: str) -> tuple[int, dict]:
                async with session.post(
                    c.urls[0] + "/v1/inference", json={"input": text}, headers=auth("paid")
                ) as r:
                    return r.status, await r.json()

            texts = ["poison __fail__"] * 5 + ["fine"] * 5
            return await asyncio.gather(*(one(t) for t in texts))

    try:
        results = asyncio.run(burst())
        assert [s for s, _ in results[:5]] == [500] * 5, results
        assert all(b["error"]["code"] == "INFERENCE_FAILED" for _, b in results[:5])
        assert [s for s, _ in results[5:]] == [200] * 5, results
        assert all(b["output"] == sim_output("fine") for _, b in results[5:])
    finally:
        c.stop()
