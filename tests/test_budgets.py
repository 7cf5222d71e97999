"""Budgets (policy ``budget``): what a key may use each calendar period, in
tokens and in GPU time, reserved as a request is admitted and settled as it
is answered, so a key stops within one request's reservation of its budget
and what it spent is what the workers measured. Real processes on a real
Redis; the periods' calendar against the Lua that counts them."""

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from infergate.base import periods, wire
from infergate.base.queue import scripts
from infergate.base.queue.gateway import Counter, GatewayQueue
from infergate.base.queue.store import Store

from tests.helpers import KEYS, SECRETS, auth, http, key_entry, policy_yaml, wait_for

TEMPLATE_TOKENS = 16  # (gateway/reservations.py: what an input's bound adds)
SIM_WORDS = 1  # (the simulated backend's answer: its input after one word)
BUDGETED = {"Authorization": "Bearer budgeted-secret"}
HARNESS = Path(__file__).parent / "lua" / "period_at.lua"


def budget_policy(**budget: Any) -> str:
    budgeted = key_entry("budgeted", "paid", "budgeted-secret", budget=budget)
    return policy_yaml(extra_keys=(budgeted,))


def budgeted_request(url: str, text: str, max_tokens: int = 0) -> tuple[int, dict[str, str], Any]:
    return http("POST", url + "/v1/inference", budgeted_body(text, max_tokens), BUDGETED)


def budgeted_body(text: str, max_tokens: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"input": text}
    if max_tokens:
        body["parameters"] = {"max_tokens": max_tokens}
    return body


async def send_budgeted(
    session: aiohttp.ClientSession, url: str, text: str, max_tokens: int = 0
) -> tuple[int, dict[str, Any], float]:
    """The budgeted key's request: its status, body, and how long it was
    told to wait before a retry (s)."""
    body = budgeted_body(text, max_tokens)
    async with session.post(url + "/v1/inference", json=body, headers=BUDGETED) as r:
        return r.status, await r.json(), int(r.headers.get("Retry-After-Ms", "0")) / 1000


async def send_until_refused(
    session: aiohttp.ClientSession, url: str, text_of: Callable[[int], str], max_tokens: int
) -> tuple[int, list[str]]:
    """One client of the budgeted key: ``text_of(n)`` for its n-th request,
    retried as told while refused for what may pass (held in flight, the
    tier's capacity), until refused for good: how many were served, and
    the refusals' codes."""
    served, codes = 0, []
    for n in range(100):
        status, body, wait_s = await send_budgeted(session, url, text_of(n), max_tokens)
        if status == 200:
            served += 1
            continue
        codes.append(body["error"]["code"])
        if codes[-1] not in ("RATE_LIMITED", "SERVICE_OVERLOADED"):
            break
        await asyncio.sleep(wait_s)  # (pacing, as told)
    return served, codes


async def clients_until_refused(
    session: aiohttp.ClientSession,
    url: str,
    text_of: Callable[[int, int], str],
    max_tokens: int,
    clients: int = 30,
) -> tuple[int, list[str]]:
    """``clients`` of the budgeted key at once (``text_of(client, n)``): all
    they were served, and all their refusals' codes."""
    ends = await asyncio.gather(
        *(send_until_refused(session, url, partial(text_of, i), max_tokens) for i in range(clients))
    )
    return sum(served for served, _ in ends), [code for _, codes in ends for code in codes]


def spent(redis_url: str, unit: str, period: str) -> int:
    """What the key's budget counts now (its period's sum)."""
    client = redis.Redis.from_url(redis_url)
    try:
        [name] = list(client.scan_iter(match=f"*budget/budgeted/{unit}/{period}"))
        return int(client.hget(name, "s") or 0)
    finally:
        client.close()


def usage_gpu_us(redis_url: str) -> int:
    """The GPU time the workers charged the key in the usage record."""
    client = redis.Redis.from_url(redis_url)
    try:
        total = 0
        for name in client.scan_iter(match="*usage*"):
            if client.type(name) == b"hash":
                total += int(client.hget(name, "paid\nbudgeted\ngpu_us") or 0)
        return total
    finally:
        client.close()


def until_midnight_s() -> float:
    now = time.time()
    return periods.ends_ms(int(now * 1000), "day") / 1000 - now


def test_a_token_budget_stops_the_key_within_one_reservation(cluster_factory) -> None:
    """Each request reserves 42 or 43 tokens and uses 7: the key is served until
    what is left is under one reservation, then refused with 429
    BUDGET_EXCEEDED until the day ends; what Redis counts is what was used."""
    c = cluster_factory(budget_policy(tokens=300, period="day"), latency_ms=10, metrics=True)
    served, used = 0, 0
    for i in range(60):
        status, headers, body = budgeted_request(c.urls[0], f"a{i} b c", 20)
        if status != 200:
            break
        served += 1
        used += 3 + body["metadata"]["tokens_used"]
    assert status == 429, body
    assert body["error"]["code"] == "BUDGET_EXCEEDED"
    assert "budget of 300 tokens a day" in body["error"]["message"]
    assert abs(int(headers["retry-after"]) - until_midnight_s()) < 5
    reservation = len(f"a{served} b c") + TEMPLATE_TOKENS + 20  # (the refused one's)
    assert used == served * 7
    assert 300 - reservation < used <= 300
    assert spent(c.redis_url, "tokens", "day") == used
    # The key's other limits are not what refused it; other keys go on.
    status, _, _ = http("POST", c.urls[0] + "/v1/inference", {"input": "x y"}, auth("paid"))
    assert status == 200
    # Operators see it spent, and the alert series counts it at both marks.
    status, _, report = http("GET", c.urls[0] + "/v1/admin/budgets", None, auth("admin"))
    assert status == 200, report
    [row] = report["keys"]
    assert (row["key_id"], row["unit"], row["period"]) == ("budgeted", "tokens", "day")
    assert (row["budget"], row["spent"], row["left"]) == (300, used, 300 - used)
    env = {**os.environ, "INFERGATE_ADMIN_KEY": SECRETS["admin"]}
    out = subprocess.run(
        [sys.executable, "-m", "infergate", "usage", "--budgets", "--url", c.urls[0]],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert re.search(rf"budgeted +paid +tokens +day +300 +{used} +{300 - used} ", out.stdout)
    [port] = [p for name, p in (c.metrics_ports or {}).items() if name.startswith("gateway")]
    metrics = http("GET", f"http://127.0.0.1:{port}/metrics")[2]
    text = metrics.decode() if isinstance(metrics, bytes) else str(metrics)
    assert 'infergate_budget_keys{mark="0.8"} 1.0' in text
    assert 'infergate_budget_keys{mark="1"} 1.0' in text


async def test_a_gpu_budget_stops_concurrent_clients_and_counts_what_the_workers_measured(
    cluster_factory,
) -> None:
    """Two gateways, 20 clients at once, a 1.2 GPU-second budget on 40 ms
    batches: every request reserves a batch of one's time and twice the
    measured time of its tokens, and gives back all but its share once
    answered. The key stops within one reservation of the
    budget, its count in Redis is the usage record's GPU time to the
    microsecond, and no admit ever left Redis over the budget."""
    budget_us = 1_200_000
    c = cluster_factory(
        budget_policy(gpu_seconds=budget_us / 1e6, period="week"), gateways=2, latency_ms=40
    )
    statuses: list[int] = []
    most = 0

    async def watch(done: asyncio.Event) -> None:
        nonlocal most
        client = redis.asyncio.Redis.from_url(c.redis_url)
        try:
            while not done.is_set():
                async for name in client.scan_iter(match="*budget/budgeted/gpu_us/week"):
                    most = max(most, int(await client.hget(name, "s") or 0))
                await asyncio.sleep(0.003)
        finally:
            await client.aclose()

    async with aiohttp.ClientSession() as session:

        async def client(n: int) -> None:
            for i in range(200):
                body = {"input": f"c{n} r{i}", "parameters": {"max_tokens": 4}}
                async with session.post(
                    c.urls[n % 2] + "/v1/inference", json=body, headers=BUDGETED
                ) as r:
                    body = await r.json()
                    statuses.append(r.status)
                    if r.status != 200:
                        assert r.status == 429, body
                        if body["error"]["code"] == "RATE_LIMITED":  # (held: in flight)
                            await asyncio.sleep(int(r.headers["Retry-After-Ms"]) / 1000)
                            continue
                        assert body["error"]["code"] == "BUDGET_EXCEEDED", body
                        return

        done = asyncio.Event()
        watching = asyncio.create_task(watch(done))
        await asyncio.gather(*(client(n) for n in range(20)))
        done.set()
        await asyncio.wait_for(watching, 5)
    # What in-flight reservations gave back after the clients were refused:
    # used one request at a time until it is under one reservation.
    for i in range(100):
        status, _, body = budgeted_request(c.urls[0], f"last {i}", 4)
        if status != 200:
            break
    assert body["error"]["code"] == "BUDGET_EXCEEDED"
    settled = spent(c.redis_url, "gpu_us", "week")
    served = statuses.count(200)
    print(f"served {served}, spent {settled} of {budget_us} µs, Redis held {most} at most")
    assert served > 20
    assert settled == usage_gpu_us(c.redis_url)
    # (a reservation: the slowest batch measured, some 40-60 ms on a busy machine)
    assert budget_us - 150_000 < settled <= budget_us + 20_000
    assert most <= budget_us + 20_000


async def test_long_inputs_after_short_ones_do_not_overshoot_a_gpu_budget(cluster_factory) -> None:
    """Another key's short requests first (the measured rate a token is
    theirs), then 30 long ones of the budgeted key at once, on a model whose
    time grows with what it reads and writes, retried while told to: each
    reserves for its own tokens, so the budget holds (a reservation of a
    whole batch's time, as measured on the short ones, let such a burst
    spend 11x a budget)."""
    budget_us = 2_000_000
    c = cluster_factory(
        budget_policy(gpu_seconds=budget_us / 1e6, period="day"),
        latency_ms=20,
        worker_args=["--sim-ms-per-ktoken", "100"],
    )
    long = " ".join(["word"] * 390)  # (within the paid tier's 2000 characters)
    async with aiohttp.ClientSession() as session:

        async def short(i: int) -> None:
            body = {"input": f"s{i}", "parameters": {"max_tokens": 4}}
            headers = auth("paid")
            async with session.post(c.urls[0] + "/v1/inference", json=body, headers=headers) as r:
                assert r.status == 200

        for burst in (1, 3, 8, 2, 12, 5):  # (calls of several sizes: the line is fitted)
            await asyncio.gather(*(short(burst * 100 + i) for i in range(burst)))

        served, codes = await clients_until_refused(
            session, c.urls[0], lambda i, n: f"{i}.{n} {long}", 4
        )
    settled = spent(c.redis_url, "gpu_us", "day")
    print(f"served {served}, refused {len(codes)} times, spent {settled} of {budget_us} µs")
    assert served >= 5
    assert settled == usage_gpu_us(c.redis_url)
    assert settled <= budget_us * 1.1


async def test_a_key_that_trained_its_line_on_short_calls_cannot_overspend_with_long_ones(
    cluster_factory,
) -> None:
    """The budgeted key trains its own line: one-word inputs of 450
    characters, then 275 one-letter words, on a model whose time grows
    with tokens. Then 30 inputs of 1,950 one-letter words at once,
    max_tokens 1, retried while told to (the budget held in flight, the
    tier's capacity): far larger than any request measured, the first
    takes what is left of the budget and runs as the key's only one; the
    rest are drawn from the line it taught, and the budget is never
    overspent (drawn from the short calls' line, long inputs spent 7.3 s
    of 6)."""
    budget_us = 6_000_000
    budgeted = key_entry(
        "budgeted", "paid", "budgeted-secret", budget={"gpu_seconds": 6, "period": "day"}
    )
    c = cluster_factory(
        policy_yaml(extra_keys=(budgeted,), tiers={"paid": {"max_input_chars": 4000}}),
        latency_ms=20,
        worker_args=["--sim-ms-per-ktoken", "100"],
    )
    async with aiohttp.ClientSession() as session:
        for i in range(12):
            text = f"{i} " + " ".join("a" * 275) if i % 2 else f"{i}" + "y" * 450
            status, body, _ = await send_budgeted(session, c.urls[0], text)
            assert status == 200, body

        served, codes = await clients_until_refused(
            session, c.urls[0], lambda i, n: f"{i} " + " ".join("z" * 1950), 1
        )
    settled = spent(c.redis_url, "gpu_us", "day")
    print(f"served {served}, refused {len(codes)} times, spent {settled} of {budget_us} µs")
    assert codes.count("BUDGET_EXCEEDED") == 30
    assert served >= 5
    assert settled == usage_gpu_us(c.redis_url) <= budget_us


async def test_a_key_that_trained_its_line_on_one_size_cannot_overspend_with_more_tokens(
    cluster_factory,
) -> None:
    """The budgeted key trains its line on calls of one size, alone: one
    word of 400 emoji (1,600 bytes), a few tokens a call. Then 30 inputs of
    800 one-letter words at once (as many bytes, 200 times the tokens),
    max_tokens 1, on a model whose time grows with tokens, retried while
    told to: calls of one size measured no part per token, so past the
    largest one a request is drawn in proportion to its tokens' bound, and
    the budget is never overspent (drawn from the mean call alone, they
    spent 1.4x the budget)."""
    budget_us = 2_000_000
    budgeted = key_entry(
        "budgeted", "paid", "budgeted-secret", budget={"gpu_seconds": 2, "period": "day"}
    )
    c = cluster_factory(
        policy_yaml(extra_keys=(budgeted,)),
        latency_ms=20,
        worker_args=["--sim-ms-per-ktoken", "100"],
    )
    async with aiohttp.ClientSession() as session:
        for i in range(12):
            status, body, _ = await send_budgeted(
                session, c.urls[0], f"{i:02}" + "\U0001f600" * 400
            )
            assert status == 200, body

        served, codes = await clients_until_refused(
            session, c.urls[0], lambda i, n: f"{i}.{n} " + " ".join("a" * 797), 1
        )
    settled = spent(c.redis_url, "gpu_us", "day")
    print(f"served {served}, refused {len(codes)} times, spent {settled} of {budget_us} µs")
    assert codes.count("BUDGET_EXCEEDED") == 30
    assert served >= 5
    assert settled == usage_gpu_us(c.redis_url) <= budget_us


async def test_another_keys_slow_calls_do_not_lock_a_budgeted_key_out(cluster_factory) -> None:
    """Another key's calls take seconds (more than the whole budget); then
    the budgeted key sends 20 tiny requests at once. Its first takes the
    budget while the key has no calls of its own, the rest are told to
    retry once it is answered (429, worth a retry), and every one is
    served: by its own calls, the key reserves what its own requests take
    (the least a cut was the slowest call of any key's, over the budget:
    refused with no retry until the period's end, its budget unspent)."""
    budget_us = 2_000_000
    c = cluster_factory(
        policy_yaml(
            extra_keys=(
                key_entry(
                    "budgeted",
                    "paid",
                    "budgeted-secret",
                    budget={"gpu_seconds": budget_us / 1e6, "period": "day"},
                ),
            ),
            tiers={"paid": {"max_input_chars": 4000}},
        ),
        latency_ms=20,
        worker_args=["--sim-ms-per-ktoken", "100"],
    )
    async with aiohttp.ClientSession() as session:

        async def huge(i: int) -> None:
            body = {"input": f"{i} " + " ".join("h" * 1995)}
            url = c.urls[0] + "/v1/inference"
            async with session.post(url, json=body, headers=auth("paid")) as r:
                assert r.status == 200, await r.text()

        await asyncio.gather(*(huge(i) for i in range(8)))

        async def tiny(i: int) -> list[str]:
            codes = []
            for _ in range(50):
                body = {"input": f"t{i}", "parameters": {"max_tokens": 2}}
                url = c.urls[0] + "/v1/inference"
                async with session.post(url, json=body, headers=BUDGETED) as r:
                    if r.status == 200:
                        return codes
                    codes.append((await r.json())["error"]["code"])
                    if codes[-1] != "RATE_LIMITED":
                        return codes
                    await asyncio.sleep(int(r.headers["Retry-After-Ms"]) / 1000)
            return codes

        refused = await asyncio.gather(*(tiny(i) for i in range(20)))
    settled = spent(c.redis_url, "gpu_us", "day")
    print(f"refused {sum(map(len, refused))} times, spent {settled} of {budget_us} µs")
    assert not any("BUDGET_EXCEEDED" in codes for codes in refused), refused
    assert all(len(codes) < 50 for codes in refused)
    assert settled == usage_gpu_us(c.redis_url) < budget_us / 2


def test_a_request_estimated_past_what_is_left_takes_the_rest_and_settles(
    cluster_factory,
) -> None:
    """After calls of one short size alone, a long request's GPU estimate
    (the line's, proportional beyond what was measured) is far over what is
    left of the budget: it takes what is left, runs, and settles to what it
    used. Refused instead, it waited for the period's end with most of the
    budget unspent. A list is never cut so (cut, a list of 100 prompts ran
    on what was left of one's: 5.9 s of a 2 s budget): estimated past the
    budget, it is refused whole, uncharged; one that fits runs. (The
    budget leaves the short list room for calls measured several times
    slower than the 10 ms asked, as on a busy machine: at 0.5 s, its
    estimate of 0.26 s went past the budget when they measured twice that.)"""
    budget_us = 2_000_000
    c = cluster_factory(budget_policy(gpu_seconds=budget_us / 1e6, period="day"), latency_ms=10)
    for i in range(10):  # (one at a time: every call of one size)
        status, _, _ = budgeted_request(c.urls[0], f"s{i}", 2)
        assert status == 200
    before = spent(c.redis_url, "gpu_us", "day")
    status, _, body = budgeted_request(c.urls[0], "long " + "x" * 1900, 2)
    assert status == 200, body
    settled = spent(c.redis_url, "gpu_us", "day")
    print(f"spent {before} µs on the short ones, {settled} after the long one")
    assert before < settled < budget_us / 2
    assert settled == usage_gpu_us(c.redis_url)
    prompts = [f"long {i} " + "x" * 1500 for i in range(4)]
    body = {"model": "default", "prompt": prompts, "max_tokens": 2}
    status, _, answer = http("POST", c.urls[0] + "/v1/completions", body, BUDGETED)
    assert status == 429, answer
    assert "as estimated" in answer["error"]["message"], answer
    assert spent(c.redis_url, "gpu_us", "day") == settled
    body = {"model": "default", "prompt": [f"s{i}" for i in range(10, 14)], "max_tokens": 2}
    status, _, answer = http("POST", c.urls[0] + "/v1/completions", body, BUDGETED)
    assert status == 200, answer
    assert settled < spent(c.redis_url, "gpu_us", "day") == usage_gpu_us(c.redis_url)


def test_a_key_with_no_call_measured_is_cut_to_no_less_than_a_batch_or_a_tenth(
    cluster_factory,
) -> None:
    """Gateway 0 has measured no call of the key's; the worker's batches
    take 400 ms and 50 ms of a 1 s budget is left: a request there is not
    cut to less than the fleet's slowest batch (with the margin) or a tenth
    of the budget, whichever is less, so it waits and the budget never ends
    more than a batch over (cut to a tenth of a second's margin, it ran,
    and the budget counted 1.2 of 1 s; the least is held to a tenth of the
    budget so that another key's slow calls lock none out of more)."""
    budget_us = 1_000_000
    c = cluster_factory(
        budget_policy(gpu_seconds=budget_us / 1e6, period="day"), latency_ms=400, gateways=2
    )
    for i in range(2):
        status, _, body = http(
            "POST", c.urls[1] + "/v1/inference", {"input": f"w{i}"}, auth("paid")
        )
        assert status == 200, body
    client = redis.Redis.from_url(c.redis_url)

    def batch_ms() -> float:
        beats = [client.get(name) for name in client.scan_iter(match="*hb:worker:*")]
        return max((wire.decode_heartbeat(b).batch_ms for b in beats if b), default=0.0)

    wait_for(lambda: batch_ms() > 300, 10, "the worker publishes its batch time")
    seconds, micros = client.time()
    day = str(periods.index_at(seconds * 1000 + micros // 1000, "day"))
    name = "{infergate}:quota:budget/budgeted/gpu_us/day"
    client.hset(name, mapping={day: 950_000, "s": 950_000, "l": day})
    client.close()
    status, _, body = budgeted_request(c.urls[0], "x")
    assert status == 429, body
    assert body["error"]["code"] == "BUDGET_EXCEEDED"
    assert spent(c.redis_url, "gpu_us", "day") == 950_000


def test_the_openai_client_makes_one_call_for_a_spent_budget(cluster_factory) -> None:
    """BUDGET_EXCEEDED carries x-should-retry: false, so the openai client
    (which retries a 429 twice by default) asks once."""
    c = cluster_factory(budget_policy(tokens=100, period="month"), latency_ms=10)
    calls: list[str] = []
    transport = httpx.Client(event_hooks={"request": [lambda r: calls.append(r.url.path)]})
    client = openai.OpenAI(
        base_url=c.urls[0] + "/v1", api_key="budgeted-secret", http_client=transport
    )
    # (reserves 2 + 16 + 80 of 100 and uses 3: 97 left, under the next's 98)
    first = client.completions.create(model="default", prompt="hi", max_tokens=80)
    assert first.choices[0].text
    calls.clear()
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model="default", prompt="ho", max_tokens=80)
    assert calls == ["/v1/completions"]
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert refused.value.code == "budget_exceeded"
    assert refused.value.type == "insufficient_quota"
    transport.close()


# The periods' edges: month ends (a leap February among them), a year's end,
# and the week's (Monday, UTC).
EDGES = [
    datetime(2024, 2, 29, 23, 59, 59, 999000, tzinfo=UTC),
    datetime(2024, 3, 1, tzinfo=UTC),
    datetime(2026, 12, 31, 23, 59, 59, 999000, tzinfo=UTC),
    datetime(2027, 1, 1, tzinfo=UTC),
    datetime(2026, 11, 30, tzinfo=UTC),  # (a Monday)
    datetime(2100, 3, 1, tzinfo=UTC),
    datetime(1970, 1, 1, tzinfo=UTC),
]


@pytest.fixture
def period_at(module_redis):
    client = redis.Redis.from_url(module_redis.url)
    script = client.register_script(scripts.libraries("admit") + "\n" + HARNESS.read_text())
    yield lambda ms, period: tuple(script(args=[ms, period]))
    client.close()


def test_the_periods_edges_agree_with_the_calendar(period_at) -> None:
    for edge in EDGES:
        ms = round(edge.timestamp() * 1000)
        for period in ("day", "week", "month"):
            assert period_at(ms, period) == (
                periods.index_at(ms, period),
                periods.ends_ms(ms, period),
            )
        ends = datetime.fromtimestamp(periods.ends_ms(ms, "month") / 1000, UTC)
        assert (ends.day, ends.hour, ends.minute) == (1, 0, 0)
        assert ends > edge
        week_ends = datetime.fromtimestamp(periods.ends_ms(ms, "week") / 1000, UTC)
        assert week_ends.weekday() == 0
        assert edge < week_ends <= edge + timedelta(days=7)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ms=st.integers(0, 2**42), period=st.sampled_from(["day", "week", "month"]))
def test_the_lua_counts_periods_as_python_does(period_at, ms: int, period: str) -> None:
    index, ends = period_at(ms, period)
    assert (index, ends) == (periods.index_at(ms, period), periods.ends_ms(ms, period))
    assert ms < ends
    assert periods.index_at(ends, period) == index + 1
    assert periods.index_at(ends - 1, period) == index


def test_an_excess_settled_after_its_period_ended_is_charged_to_the_current_one(
    module_redis,
) -> None:
    """A request reserved in one period and answered, over its reservation,
    in the next: its excess is charged to the period now running (the ended
    one counts nothing); a give-back to an ended period changes nothing;
    excesses too large to count as digits count to 2^50 at most."""
    client = redis.Redis.from_url(module_redis.url, decode_responses=True)
    settle = client.register_script(scripts.source("settle"))
    budget, window = "{t}:quota:budget/k/gpu_us/month", "{t}:quota:LIMITER/tokens/k/9/1/day"
    client.delete(budget, window)

    def current() -> int:
        seconds, micros = client.time()
        return periods.index_at(seconds * 1000 + micros // 1000, "month")

    ended = current() - 1
    client.hset(budget, mapping={str(ended): 500, "s": 500, "l": str(ended)})
    before = current()
    settle(keys=[budget], args=[ended, -200, 100])
    now = str(current())
    assert now == str(before)  # (not run across a month's end)
    assert client.hgetall(budget) == {now: "200", "s": "200", "l": now, "f": "0"}
    settle(keys=[budget, budget], args=[ended, 40, 100, now, -50, 100])
    assert client.hgetall(budget) == {now: "250", "s": "250", "l": now, "f": "0"}
    for _ in range(3):
        settle(keys=[budget], args=[now, -(10**17), 1])
    assert client.hget(budget, "s") == str(2**50)
    client.hset(window, mapping={"4": 7, "5": 3, "s": 10, "l": "5"})
    for _ in range(3):
        settle(keys=[window], args=["5", -(10**17), 1])
    # ('s' stays the buckets' sum: the window moves on by it)
    assert client.hmget(window, "4", "5", "s") == ["7", str(2**50 - 7), str(2**50)]
    client.close()


async def test_a_refusal_says_whether_what_is_in_flight_may_make_room(redis_url: str) -> None:
    """A budget of 1000 with 600 reserved in flight: a request of 600 is
    refused as held (ms 0: 'retry when they are answered'), one of 950 too
    (it fits if they use nothing), one of 1500 never fits, and once the
    600 settles at 100 used, one of 950 is refused until the period ends
    (nothing is in flight), and one of 900 fits."""
    store = Store.connect(redis_url, "t", block_s=1, name="test")
    try:
        gateway = GatewayQueue(store, "gw")
        name = gateway.counter_key("budget/k/gpu_us/day")
        await store.redis.delete(name)

        def budget(cost: int) -> Counter:
            return Counter(name, cost, 1000, 0, True, "day")

        first = await gateway.admit([budget(600)])
        assert first.admitted
        for cost, ms in ((600, 0), (950, 0)):
            refused = await gateway.admit([budget(cost)])
            assert (refused.admitted, refused.ttls_ms[0]) == (False, ms), cost
        never = await gateway.admit([budget(1500)])
        assert not never.admitted
        assert never.ttls_ms[0] > 0
        await gateway.settle([(budget(600), first.now_ms, 500)])
        assert await store.redis.hmget(name, "s", "f") == [b"100", b"0"]
        spent_out = await gateway.admit([budget(950)])
        assert not spent_out.admitted
        assert spent_out.ttls_ms[0] > 0
        second = await gateway.admit([budget(900)])
        assert second.admitted
        assert await store.redis.hget(name, "f") == b"900"
    finally:
        await store.close()


def test_a_budget_raised_within_its_period_keeps_what_was_spent() -> None:
    """A budget's counter is named by key, unit and period, not amount."""
    from infergate.gateway.quota import Quota
    from infergate.policies import Budget

    class Queue:
        def counter_key(self, name: str) -> str:
            return name

    quota = Quota(Queue())  # type: ignore[arg-type]
    small = quota.budget_charges("k", Budget(gpu_seconds=1, tokens=10))
    large = quota.budget_charges("k", Budget(gpu_seconds=5, tokens=99))
    assert [c.counter.key for c in small] == [c.counter.key for c in large]
    daily = quota.budget_charges("k", Budget(tokens=10, period="day"))
    assert daily[0].counter.key != small[0].counter.key


@pytest.mark.parametrize(
    ("budget", "error"),
    [
        ({}, "give gpu_seconds, tokens or both"),
        ({"tokens": 0}, "tokens: must be 1 to"),
        ({"gpu_seconds": -1}, "gpu_seconds: must be 0.001 to"),
        ({"gpu_seconds": float("nan")}, "gpu_seconds: must be 0.001 to"),
        ({"tokens": 5, "period": "year"}, "period"),
        ({"tokens": 5, "spend": 3}, "spend"),
    ],
)
def test_a_budget_that_means_nothing_is_refused(budget: dict[str, Any], error: str) -> None:
    from infergate.policies import PolicyError, parse_policy

    with pytest.raises(PolicyError, match=error):
        parse_policy(budget_policy(**budget))


async def test_a_request_dropped_unrun_gives_back_all_it_reserved(cluster_factory) -> None:
    """One worker busy for 1.5 s; meanwhile one request of the key times
    out in the queue and another's client leaves. The take that drops them
    unrun gives back their reservations, so the token window and the
    budget count nothing; a request that ran keeps its charge."""
    budgeted = key_entry(
        "budgeted",
        "paid",
        "budgeted-secret",
        token_limits=["1000/hour"],
        budget={"tokens": 1000, "period": "day"},
    )
    c = cluster_factory(policy_yaml(extra_keys=(budgeted,)), latency_ms=1500)
    client = redis.asyncio.Redis.from_url(c.redis_url)
    try:
        await requests_dropped_unrun(c, client)
    finally:
        await client.aclose()


async def requests_dropped_unrun(c: Any, client: Any) -> None:

    async def counted() -> list[int]:
        names = [n async for n in client.scan_iter(match="*quota:*budgeted*")]
        assert len(names) == 2  # (the token limit's window, and the budget)
        return [int(await client.hget(n, "s") or 0) for n in names]

    async with aiohttp.ClientSession() as session:
        busy = asyncio.create_task(
            session.post(c.urls[0] + "/v1/inference", json={"input": "busy"}, headers=auth("paid"))
        )
        for _ in range(200):  # (10 s at most: until a worker has taken it)
            if int(await client.hget(KEYS.stats, "batches_formed") or 0):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("no worker took the busy request")
        timed_out = session.post(
            c.urls[0] + "/v1/inference",
            json={"input": "late", "timeout_ms": 300, "parameters": {"max_tokens": 10}},
            headers=BUDGETED,
        )
        async with timed_out as r:
            assert r.status == 504, await r.text()
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(
                c.urls[0] + "/v1/inference",
                json={"input": "gone", "parameters": {"max_tokens": 10}},
                headers=BUDGETED,
                timeout=aiohttp.ClientTimeout(total=0.3),
            ):
                pass
        assert all(n > 0 for n in await counted())  # (both reserved, not yet given back)
        async with await busy as r:
            assert r.status == 200
    for _ in range(200):  # (10 s at most: the next take drops them)
        if not any(await counted()):
            break
        await asyncio.sleep(0.05)
    assert await counted() == [0, 0]
    [budget] = [n async for n in client.scan_iter(match="*quota:budget/budgeted/*")]
    assert await client.hget(budget, "f") == b"0"  # (nothing held in flight)
    status, _, body = budgeted_request(c.urls[0], "ran", 10)
    assert status == 200, body
    ran = 1 + (1 + SIM_WORDS)  # (its input's word, and its answer's two)
    assert await counted() == [ran, ran]
    assert await client.hget(budget, "f") == b"0"


async def test_a_request_given_up_on_while_it_ran_settles_by_its_late_reply(
    cluster_factory,
) -> None:
    """Two requests of a key with no call measured yet (each reserves what
    is left of its budget), given up on while their batch runs: one past
    its deadline, one whose client left. Their replies come after; each
    settles by what it used, so the budget counts what the workers
    measured and holds nothing in flight, and the next request runs (kept,
    their reservations held the whole budget and told the key to retry
    until the period's end)."""
    budget_us = 2_000_000
    c = cluster_factory(budget_policy(gpu_seconds=budget_us / 1e6, period="day"), latency_ms=400)
    client = redis.asyncio.Redis.from_url(c.redis_url)
    try:
        async with aiohttp.ClientSession() as session:
            url = c.urls[0] + "/v1/inference"
            body = {"input": "late", "timeout_ms": 200, "parameters": {"max_tokens": 4}}
            async with session.post(url, json=body, headers=BUDGETED) as r:
                assert r.status == 504, await r.text()
            await wait_settled(c, client)
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(
                    url,
                    json={"input": "gone", "parameters": {"max_tokens": 4}},
                    headers=BUDGETED,
                    timeout=aiohttp.ClientTimeout(total=0.2),
                ):
                    pass
            await wait_settled(c, client)
            assert 0 < spent(c.redis_url, "gpu_us", "day") < budget_us / 2
            async with session.post(url, json={"input": "next"}, headers=BUDGETED) as r:
                assert r.status == 200, await r.text()
    finally:
        await client.aclose()


async def wait_settled(c: Any, client: Any) -> None:
    """Until the key's GPU budget holds nothing in flight and counts what
    the workers measured (10 s at most)."""
    for _ in range(200):
        names = [n async for n in client.scan_iter(match="*quota:budget/budgeted/gpu_us/*")]
        held = [await client.hmget(n, "f", "s") for n in names]
        if held and held[0][0] == b"0" and int(held[0][1]) == usage_gpu_us(c.redis_url):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the budget still holds {held} in flight")


def test_each_prompt_of_a_list_settles_its_own_part(cluster_factory) -> None:
    """A list of prompts reserves for all of them in one step; each gives
    back what it did not use as it is answered, so the budget counts what
    the list used (it kept the whole reservation before: some 7x)."""
    c = cluster_factory(budget_policy(tokens=10_000, period="day"), latency_ms=10)
    prompts = [f"p{i} a b" for i in range(16)]
    body = {"model": "default", "prompt": prompts, "max_tokens": 2}
    status, _, answer = http("POST", c.urls[0] + "/v1/completions", body, BUDGETED)
    assert status == 200, answer
    assert len(answer["choices"]) == 16
    assert spent(c.redis_url, "tokens", "day") == answer["usage"]["total_tokens"]


def test_a_list_answered_from_the_cache_settles_what_it_used(cluster_factory) -> None:
    """A list's prompts answered from the cache settle their parts too, as a
    cached request is charged: its input's bound and its answer's tokens
    (each kept its whole reservation before: 237 counted for 99 used)."""
    budgeted = key_entry("budgeted", "paid", "budgeted-secret", budget={"tokens": 10_000, "period": "day"})  # fmt: skip
    c = cluster_factory(policy_yaml(extra_keys=(budgeted,), sharing={"cache_ttl_s": 60}), latency_ms=10)  # fmt: skip
    prompts = [f"p{i} a b" for i in range(3)]
    body = {"model": "default", "prompt": prompts, "max_tokens": 50}
    status, _, first = http("POST", c.urls[0] + "/v1/completions", body, BUDGETED)
    assert status == 200, first
    assert spent(c.redis_url, "tokens", "day") == first["usage"]["total_tokens"]
    status, _, again = http("POST", c.urls[0] + "/v1/completions", body, BUDGETED)
    assert status == 200, again
    answers = sum(len(choice["text"].split()) for choice in again["choices"])
    assert answers == 3 * 4  # (each its input's 3 words and one: far under 50)
    bounds = sum(len(p.encode()) + TEMPLATE_TOKENS for p in prompts) + answers
    assert spent(c.redis_url, "tokens", "day") == first["usage"]["total_tokens"] + bounds


def test_a_job_settles_what_it_used_and_one_that_never_ran_gives_all_back(
    cluster_factory,
) -> None:
    """A job reserves as a request does and settles as its record is
    finished (by its result's tokens and measured GPU time); one cancelled
    while queued, or dropped past its deadline, gives all of it back. A
    job of a key with nothing measured at its gateway reserves what is
    left of the budget: the next waits for it, until a job's result read
    at the gateway teaches it the key's line (before, a key of jobs alone
    ran one at a time for good)."""
    c = cluster_factory(budget_policy(tokens=10_000, gpu_seconds=100, period="day"))
    status, _, job = http("POST", c.urls[0] + "/v1/jobs", {"input": "a b c"}, BUDGETED)
    assert status == 202, job
    status, _, held = http("POST", c.urls[0] + "/v1/jobs", {"input": "d"}, BUDGETED)
    assert (status, held["error"]["code"]) == (429, "RATE_LIMITED"), held
    view = wait_for(lambda: finished_job(c, job["job_id"]), 15, "the job to finish")
    assert view["status"] == "succeeded", view
    used = 3 + len(view["result"]["output"].split())  # (its input's words, its output's)
    assert spent(c.redis_url, "tokens", "day") == used
    assert spent(c.redis_url, "gpu_us", "day") == usage_gpu_us(c.redis_url) > 0
    more = [http("POST", c.urls[0] + "/v1/jobs", {"input": f"g{i} h"}, BUDGETED) for i in range(2)]
    assert [status for status, _, _ in more] == [202, 202], more  # (estimated: both at once)
    for _, _, job in more:
        wait_for(lambda job=job: finished_job(c, job["job_id"]), 15, "the jobs to finish")
    status, _, body = budgeted_request(c.urls[0], "e f", 4)  # (its key's line: measured)
    assert status == 200, body
    used = spent(c.redis_url, "tokens", "day")

    c.stop_workers()  # (the next two never run)
    ids = []
    for body in ({"input": "cancel me"}, {"input": "too late", "timeout_ms": 1500}):
        status, _, job = http("POST", c.urls[0] + "/v1/jobs", body, BUDGETED)
        assert status == 202, job
        ids.append(job["job_id"])
    assert spent(c.redis_url, "tokens", "day") > used  # (both reserved)
    reserved = spent(c.redis_url, "tokens", "day") - used
    status, _, view = http("DELETE", f"{c.urls[0]}/v1/jobs/{ids[0]}", headers=BUDGETED)
    assert (status, view["status"]) == (200, "cancelled"), view
    assert used < spent(c.redis_url, "tokens", "day") < used + reserved  # (one given back)
    wait_for(lambda: job_status(c, ids[1]) == "expired", 10, "the second job's deadline")
    c.add_worker()  # (it is dropped, unrun)
    wait_for(
        lambda: spent(c.redis_url, "tokens", "day") == used,
        15,
        "the job dropped unrun to give back its reservation",
    )
    assert spent(c.redis_url, "gpu_us", "day") == usage_gpu_us(c.redis_url)


def job_status(c: Any, job_id: str) -> str:
    status, _, view = http("GET", f"{c.urls[0]}/v1/jobs/{job_id}", headers=BUDGETED)
    assert status == 200, view
    return str(view["status"])


def finished_job(c: Any, job_id: str) -> dict[str, Any] | None:
    status, _, view = http("GET", f"{c.urls[0]}/v1/jobs/{job_id}?wait_s=1", headers=BUDGETED)
    assert status == 200, view
    return view if view["status"] in ("succeeded", "failed") else None
