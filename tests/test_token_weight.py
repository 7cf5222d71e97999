"""The new token's weight a worker fits to its own calls
(``gpu/token_weight.py``): found where the calls tell a new token from an
input token, one where they cannot."""

import asyncio
import random

import aiohttp
import pytest
import redis
from infergate.gpu.token_weight import LEAST_CALLS, MOST_WEIGHT, NewTokenWeight

from tests.helpers import key_entry, policy_yaml, wait_for


def _calls(weight: NewTokenWeight, rng: random.Random, us_of, count: int = 400) -> None:
    for _ in range(count):
        read, wrote = rng.randint(1, 2_000), rng.randint(1, 300)
        weight.took(read, wrote, round(us_of(read, wrote)))


@pytest.mark.parametrize("true_weight", [1.0, 5.0, 39.0])
def test_the_weight_of_calls_whose_time_follows_their_tokens(true_weight: float) -> None:
    rng, weight = random.Random(1), NewTokenWeight()
    per_input_us = 1_500.0  # (SmolLM2-135M on this CPU: docs/performance.md)

    def us_of(read: int, wrote: int) -> float:
        exact = 20_000 + per_input_us * (read + true_weight * wrote)
        return exact * rng.uniform(0.9, 1.1)  # (a busy machine's noise)

    _calls(weight, rng, us_of)
    assert true_weight * 0.85 <= weight.weight <= true_weight * 1.15
    # A request's tokens as input tokens' worth, one more.
    assert weight.weighed(100, 10) == 101 + round(weight.weight * 10)


def test_one_until_enough_calls_and_when_the_calls_cannot_tell() -> None:
    rng, weight = random.Random(2), NewTokenWeight()
    for _ in range(LEAST_CALLS - 1):
        read = rng.randint(1, 2_000)
        weight.took(read, 30, 1_000 * read + 40_000 * 30)
    assert weight.weight == 1.0  # (too few calls)
    # Answers as long as their inputs, always: either could be what costs.
    weight = NewTokenWeight()
    for _ in range(400):
        read = rng.randint(1, 2_000)
        weight.took(read, read // 4, round(1_000 * read + 40_000 * (read // 4)))
    assert weight.weight == 1.0
    # A model whose time follows nothing of the tokens: noise has no weight.
    weight = NewTokenWeight()
    _calls(weight, rng, lambda read, wrote: rng.uniform(90_000, 110_000))
    assert weight.weight == 1.0


def test_held_within_its_bounds() -> None:
    rng = random.Random(3)
    # Writing costs nothing at all (a new token is at least an input token's).
    cheap = NewTokenWeight()
    _calls(cheap, rng, lambda read, wrote: 1_000 * read + 1 * wrote + rng.uniform(0, 100))
    assert cheap.weight == 1.0
    dear = NewTokenWeight()
    _calls(dear, rng, lambda read, wrote: read + 100_000 * wrote)
    assert dear.weight == MOST_WEIGHT


# (the simulated model: 2 ms a call, 0.1 ms an input token, 1 ms a new one)
NEW_TOKEN_WEIGHT = 10.0
KEYS = ("reader", "writer")


def _usage(redis_url: str) -> dict[str, dict[str, int]]:
    """Each key's usage record, summed over its hours."""
    client = redis.Redis.from_url(redis_url)
    try:
        out = {key: dict.fromkeys(("gpu_us", "input_tokens", "output_tokens"), 0) for key in KEYS}
        for name in client.scan_iter(match="*usage*"):
            if client.type(name) == b"hash":
                for key, counts in out.items():
                    for what in counts:
                        counts[what] += int(client.hget(name, f"paid\n{key}\n{what}") or 0)
        return out
    finally:
        client.close()


async def _send(url: str, rounds: int, rng: random.Random) -> None:
    """Both keys at once, eight clients each: the reader's long inputs with
    one word of answer, the writer's short inputs answered whole (the
    simulated model's answer is its input, one word more)."""
    async with aiohttp.ClientSession() as session:

        async def client(key: str) -> None:
            for _ in range(rounds):
                words = rng.randint(100, 300) if key == "reader" else rng.randint(10, 60)
                text = " ".join(f"{rng.randrange(10_000):04}" for _ in range(words))
                body: dict = {"input": text}
                if key == "reader":
                    body["parameters"] = {"max_tokens": 1}
                headers = {"Authorization": f"Bearer {key}-secret"}
                async with session.post(url, json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()

        await asyncio.gather(*(client(key) for key in KEYS for _ in range(8)))


async def test_each_key_pays_for_its_new_tokens_as_the_model_costs_them(cluster_factory) -> None:
    """A key of short prompts and long answers pays what its answers cost:
    its share of a call's time over a reader's follows their input tokens
    plus their new tokens weighed as the worker measured them (not alike:
    before, 0.2 of what the writer's requests cost)."""
    keys = tuple(key_entry(key, "paid", f"{key}-secret") for key in KEYS)
    c = cluster_factory(
        policy_yaml(extra_keys=keys, max_batch_size=8, tiers={"paid": {"latency_budget_ms": 5000}}),
        latency_ms=2,
        worker_args=[
            "--sim-ms-per-ktoken",
            "100",
            "--sim-new-token-weight",
            str(NEW_TOKEN_WEIGHT),
        ],
    )
    url, rng = c.urls[0] + "/v1/inference", random.Random(5)
    await _send(url, 12, rng)  # (the worker's calls, to fit the weight to)
    before = wait_for(lambda: _usage(c.redis_url), 10, "the usage records")
    await _send(url, 6, rng)
    after = wait_for(
        lambda: (u := _usage(c.redis_url))["writer"]["gpu_us"] > before["writer"]["gpu_us"] and u,
        10,
        "the measured round's usage",
    )
    cost, paid = {}, {}
    for key in KEYS:
        spent = {what: after[key][what] - before[key][what] for what in after[key]}
        paid[key] = spent["gpu_us"]
        cost[key] = spent["input_tokens"] + NEW_TOKEN_WEIGHT * spent["output_tokens"]
    ratio = (paid["writer"] / paid["reader"]) / (cost["writer"] / cost["reader"])
    print(f"paid {paid}, cost in input tokens {cost}, paid over cost, writer to reader {ratio:.2f}")
    assert 0.8 <= ratio <= 1.25
