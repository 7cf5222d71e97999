"""Admission that keeps its word, and fairness between the keys of a tier:
real gateways, dispatcher and workers on a real Redis, driven over HTTP with
distinct inputs (identical ones would collapse), each answer checked as its
own. Each of these failed on the code before fair queuing and the new
estimate (docs/performance.md has the numbers before and after)."""

import asyncio
import random
import time

import aiohttp
from infergate.gpu.backends.simulated import sim_output

from tests.helpers import SECRETS, Cluster, http, key_entry, policy_yaml

BUDGETS = {"enterprise": {"latency_budget_ms": 2000}, "paid": {"latency_budget_ms": 1000}}
FREE = {"latency_budget_ms": 500, "min_batch_share": 0.05}


class Sent:
    """One request's outcome: when it was due, its status, latency and whether
    a 200 answered its own input."""

    def __init__(
        self, key: str, due: float, status: int, latency_s: float, own: bool, served_s: float
    ) -> None:
        self.key, self.due, self.status, self.latency_s, self.own = key, due, status, latency_s, own
        # The gateway's own time on it (latency_ms): what its admission
        # promised, without the test's sender's lag on a busy machine.
        self.served_s = served_s


async def send(
    session: aiohttp.ClientSession, url: str, secret: str, key: str, text: str, due: float
) -> Sent:
    async with session.post(
        url + "/v1/inference", json={"input": text}, headers={"Authorization": "Bearer " + secret}
    ) as r:
        body = await r.json()
        latency = time.monotonic() - due
        own = r.status != 200 or body.get("output") == sim_output(text)
        served = body.get("latency_ms", 0.0) / 1000.0 if r.status == 200 else 0.0
        return Sent(key, due, r.status, latency, own, served)


async def open_loop(
    c: Cluster, rates: dict[str, tuple[str, float]], duration_s: float, seed: int = 1
) -> list[Sent]:
    """Poisson arrivals per key (name -> (secret, rate)), over every gateway, for
    ``duration_s``; latency counts from when each was due, so a slow sender
    does not hide a wait."""
    rng = random.Random(seed)
    plan = []
    for key, (secret, rate) in rates.items():
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= duration_s:
                break
            plan.append((t, key, secret))
    plan.sort()
    start = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = []
        for i, (t, key, secret) in enumerate(plan):
            due = start + t
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # (the arrival plan, not a wait for a condition)
            url = c.urls[i % len(c.urls)]
            text = f"{key}-{i}-{rng.random()}"
            tasks.append(asyncio.create_task(send(session, url, secret, key, text, due)))
        return list(await asyncio.gather(*tasks))


def p95(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.95 * len(values)))]


async def test_a_burst_the_fleet_clears_within_budget_is_admitted_whole(cluster_factory) -> None:
    """The issue's burst: 2 workers, 2 gateways, idle, then 300 requests of
    all three tiers at once. The code before refused some of free's third
    (its reserved slots were all it counted on once a batch was queued above)."""
    c = cluster_factory(policy_yaml(tiers={**BUDGETS, "free": FREE}), gateways=2, workers=2)
    tiers = ("enterprise", "paid", "free")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        now = time.monotonic()
        results = await asyncio.gather(
            *(
                send(
                    session, c.urls[i % 2], SECRETS[tiers[i % 3]], tiers[i % 3], f"b{i}-{now}", now
                )
                for i in range(300)
            )
        )
    statuses = {t: sorted(r.status for r in results if r.key == t) for t in tiers}
    assert statuses == {t: [200] * 100 for t in tiers}
    assert all(r.own for r in results)


async def test_a_key_that_floods_its_tier_is_the_one_refused(cluster_factory) -> None:
    """The issue's noisy neighbour: one worker of batches of 10 (about 100
    rps), two paid keys; A offers 250 rps, B 20 (well under its half). B is
    answered, within the paid budget; A's excess is what is refused."""
    keys = (key_entry("a", "paid", "a-secret"), key_entry("b", "paid", "b-secret"))
    c = cluster_factory(
        policy_yaml(max_batch_size=10, tiers={**BUDGETS, "free": FREE}, extra_keys=keys),
        gateways=1,
        workers=1,
    )
    results = await open_loop(c, {"a": ("a-secret", 250.0), "b": ("b-secret", 20.0)}, 4.0)
    a = [r for r in results if r.key == "a"]
    b = [r for r in results if r.key == "b"]
    assert all(r.own for r in results)
    b_ok = [r for r in b if r.status == 200]
    # (the code before answered 36-38 % of B's, at about 1,010 ms)
    assert len(b_ok) >= 0.97 * len(b), sorted(r.status for r in b)
    assert p95([r.latency_s for r in b_ok]) < 1.0
    a_ok = sum(r.status == 200 for r in a)
    assert sum(r.status == 503 for r in a) > 0.3 * len(a)
    # The fleet stays busy: A gets what B leaves (at least 60 of ~100 rps).
    assert a_ok >= 60 * 4.0 * 0.8, a_ok


async def test_under_overload_what_is_admitted_is_answered_within_its_budget(
    cluster_factory,
) -> None:
    """The issue's overload: one worker of batches of 10, free offered 300 rps
    and enterprise 20. Admitted free requests keep to free's 500 ms budget
    (the code before let them wait 600-750 ms); the fleet stays busy."""
    c = cluster_factory(
        policy_yaml(max_batch_size=10, tiers={**BUDGETS, "free": FREE}), gateways=1, workers=1
    )
    rates = {"free": (SECRETS["free"], 300.0), "enterprise": (SECRETS["enterprise"], 20.0)}
    results = await open_loop(c, rates, 5.0)
    assert all(r.own for r in results)
    free = [r for r in results if r.key == "free" and r.status == 200]
    free_ok = [r.latency_s for r in free]
    ent = [r for r in results if r.key == "enterprise"]
    assert all(r.status == 200 for r in ent)
    # Its budget +10 % and a margin, at the gateway (the code before: 600-750
    # ms); the client, which shares 2 cores with the stack, sees a little more.
    served = p95([r.served_s for r in free])
    assert served <= 0.5 * 1.1 + 0.05, served
    assert p95(free_ok) <= served + 0.15, (p95(free_ok), served)
    # Goodput: at least 80 % of what one worker of batches of 10 delivers.
    assert len(free_ok) + len(ent) >= 0.8 * 100 * 5.0 * 0.8


def test_a_quota_holds_in_every_window_long_span(cluster_factory) -> None:
    """A key limited to 10 a second: one request, then nine near the end of
    that second, then a burst just after it. A fixed window opened by the
    first would let the burst have 10 more (19 within a tenth of a second);
    the sliding window lets no second-long span have more than 11."""
    key = key_entry("q", "paid", "q-secret", rate_limits=["10/second"])
    c = cluster_factory(policy_yaml(extra_keys=(key,)), gateways=1, workers=2)

    def infer(i: int) -> int:
        body = {"input": f"q{i}-{time.monotonic()}"}
        return http(
            "POST", c.urls[0] + "/v1/inference", body, {"Authorization": "Bearer q-secret"}
        )[0]

    async def at(offset_s: float, first: int, count: int) -> list[int]:
        delay = start + offset_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # (the arrival plan)
        return list(
            await asyncio.gather(*(asyncio.to_thread(infer, first + i) for i in range(count)))
        )

    async def plan() -> tuple[list[int], list[int], list[int]]:
        return (
            await at(0.0, 0, 1),
            await at(0.9, 1, 9),
            await at(1.02, 10, 20),
        )

    start = time.monotonic()
    first, nine, burst = asyncio.run(plan())
    assert first == [200]
    admitted = nine.count(200) + burst.count(200)
    assert admitted <= 11, (nine, burst)
    assert set(nine + burst) <= {200, 429}
