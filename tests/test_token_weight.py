"""The new token's weight a worker fits to its own calls
(``gpu/token_weight.py``): found where the calls tell a new token from an
input token, one where they cannot."""

import asyncio
import json
import random

import aiohttp
import pytest
import redis
from infergate.base import wire
from infergate.base.keys import Keys
from infergate.gpu.answers import MOST_COUNTED, Answers, step_shares
from infergate.gpu.backend import BackendError, Counted
from infergate.gpu.backend_thread import slot_key
from infergate.gpu.backends.simulated import SimulatedBackend
from infergate.gpu.token_weight import LEAST_CALLS, TokenWeights, fleet_weights

from tests.helpers import key_entry, policy_yaml, wait_for


def _calls(weight: TokenWeights, rng: random.Random, us_of, wrote: int = 0) -> None:
    """400 calls of 1-2,000 tokens in and 1-300 out (or ``wrote`` each)."""
    for _ in range(400):
        read, new = rng.randint(1, 2_000), wrote or rng.randint(1, 300)
        weight.took(read, new, round(us_of(read, new)))


@pytest.mark.parametrize("true_weight", [1.0, 5.0, 39.0])
def test_the_weight_of_calls_whose_time_follows_their_tokens(true_weight: float) -> None:
    rng, weight = random.Random(1), TokenWeights()
    per_input_us = 1_500.0  # (SmolLM2-135M on this CPU: docs/performance.md)

    def us_of(read: int, wrote: int) -> float:
        exact = 20_000 + per_input_us * (read + true_weight * wrote)
        return exact * rng.uniform(0.9, 1.1)  # (a busy machine's noise)

    _calls(weight, rng, us_of)
    assert true_weight * 0.85 <= weight.alone <= true_weight * 1.15
    assert weight.alone == round(weight.alone, 2)  # (sent with every answer)
    # A request's tokens as input tokens' worth, one more.
    assert wire.weighed(100, 10, weight.alone) == 101 + round(weight.alone * 10)


def test_one_until_enough_calls_and_when_the_calls_cannot_tell() -> None:
    rng, weight = random.Random(2), TokenWeights()
    for _ in range(LEAST_CALLS - 1):
        read, wrote = rng.randint(1, 2_000), rng.randint(1, 300)
        weight.took(read, wrote, 1_000 * read + 40_000 * wrote)
    assert weight.alone == 1.0  # (too few calls)
    weight.took(10, 10, 10_000 + 400_000)
    assert weight.alone == 40.0  # (fitted, at the 16th)
    # Answers as long as their inputs, always: either could be what costs.
    weight = TokenWeights()
    for _ in range(400):
        read = rng.randint(1, 2_000)
        weight.took(read, read // 4, round(1_000 * read + 40_000 * (read // 4)))
    assert weight.alone == 1.0
    # Every answer of one length (a classifier's one token, a fixed max_tokens).
    for wrote in (1, 64):
        weight = TokenWeights()
        _calls(weight, rng, lambda read, _: 1_000 * read + rng.uniform(0, 5_000), wrote=wrote)
        assert weight.alone == 1.0
    # A model whose time follows nothing of the tokens: noise has no weight.
    weight = TokenWeights()
    _calls(weight, rng, lambda read, wrote: rng.uniform(90_000, 110_000))
    assert weight.alone == 1.0


def test_held_within_its_bounds() -> None:
    rng = random.Random(3)
    # Writing costs nothing at all (a new token is at least an input token's).
    cheap = TokenWeights()
    _calls(cheap, rng, lambda read, wrote: 1_000 * read + 1 * wrote + rng.uniform(0, 100))
    assert cheap.alone == 1.0
    dear = TokenWeights()
    _calls(dear, rng, lambda read, wrote: read + 100_000 * wrote)
    assert dear.alone == wire.MOST_NEW_TOKEN_WEIGHT
    # Reading costs nothing measurable (a prefill on a GPU): the most.
    free = TokenWeights()
    _calls(free, rng, lambda read, wrote: 20_000 + 5_000 * wrote + rng.uniform(0, 2_000))
    assert free.alone == wire.MOST_NEW_TOKEN_WEIGHT
    # What a planted result may say weighs within them too.
    assert [wire.held_weight(w) for w in (float("nan"), -3.0, 1e9, 7.5)] == [1.0, 1.0, 64.0, 7.5]


def test_a_worker_begins_from_the_weights_another_fitted() -> None:
    """A worker's heartbeat says its weights once its own calls fitted
    them; a worker that starts beside it begins from them, held as a fit
    holds them, until a fit of its own, and a beat's weights that mean
    nothing leave it at one."""
    fresh = TokenWeights()
    assert fresh.said() == []
    assert fresh.adopt([5.0, 2.5])
    assert (fresh.per_token, fresh.per_step, fresh.alone, fresh.said()) == (5.0, 2.5, 7.5, [])
    for planted, held in (([1e308, 5.0], (64.0, 0.0)), ([-3.0, -1.0], (1.0, 0.0))):
        weights = TokenWeights()
        assert weights.adopt(planted)
        assert (weights.per_token, weights.per_step) == held
    for meaningless in ([], [2.0], [float("nan"), 1.0], [1.0, float("inf")], [1.0, 2.0, 3.0]):
        weights = TokenWeights()
        assert not weights.adopt(meaningless)
        assert (weights.per_token, weights.per_step) == (1.0, 0.0)
    heavy = TokenWeights()
    assert heavy.adopt([60.0, 10.0])
    assert (heavy.per_token, heavy.per_step) == (60.0, 4.0)  # (alone: 64 at most)
    # Adopted for its first calls only: calls of one size, which cannot
    # tell a new token from an input token, leave it at one, as alone.
    for _ in range(LEAST_CALLS):
        heavy.took(100, 10, 5_000)
    assert (heavy.per_token, heavy.per_step, heavy.said()) == (1.0, 0.0, [])
    _calls(fresh, random.Random(3), lambda read, new: 100 * read + 900 * new)
    own = (fresh.per_token, fresh.per_step)
    assert fresh.said() == list(own)
    assert 7.0 <= own[0] + own[1] <= 9.5
    assert not fresh.adopt([30.0, 0.0])  # (its own fit stands)
    assert (fresh.per_token, fresh.per_step) == own


def test_the_weights_to_begin_from_are_those_of_the_models_workers_as_fast() -> None:
    """Of the workers of its model that take work and warmed up about as
    fast (the same device's costs), the median by a new token's weight alone:
    one planted beat among three cannot choose."""

    def beat(
        weights: list[float], model: str = "m", warm_ms: float = 100.0, **kw
    ) -> wire.Heartbeat:
        return wire.Heartbeat(
            "worker", "w", 0, 0, model=model, warm_ms=warm_ms, token_weights=weights, **kw
        )

    fleet = [beat([4.0, 1.0]), beat([64.0, 0.0], batches_done=10**20), beat([5.0, 2.0])]
    assert fleet_weights(fleet, "m", 100.0) == [5.0, 2.0]
    assert fleet_weights(fleet, "m", 0.0) == []  # (its own warm-up not measured)
    others = [
        beat([9.0, 0.0], model="other"),
        beat([9.0, 0.0], draining=True),
        beat([9.0, 0.0], warm_ms=40.0),  # (another device: 2.5x as fast)
        beat([9.0, 0.0], warm_ms=400.0),
        beat([]),
    ]
    assert fleet_weights(others, "m", 100.0) == []
    assert fleet_weights([*others, beat([3.0, 0.5], warm_ms=140.0)], "m", 100.0) == [3.0, 0.5]


def _batched_calls(weight: TokenWeights, rng: random.Random, us_of) -> None:
    """400 calls of 1-8 rows, each of 1-500 tokens in and 1-64 out."""
    for _ in range(400):
        rows = rng.randint(1, 8)
        read = [rng.randint(1, 500) for _ in range(rows)]
        wrote = [rng.randint(1, 64) for _ in range(rows)]
        exact = us_of(sum(read), sum(wrote), max(wrote))
        weight.took(sum(read), sum(wrote), round(exact * rng.uniform(0.9, 1.1)), max(wrote))


def test_a_decoding_step_weighed_apart_where_the_calls_tell_it() -> None:
    """A batched engine's step costs about the same for one row as for
    eight (SmolLM2-135M on CPU: a new token 4.6 ms a row, a step 68 ms):
    fitted apart from a new token's weight, each drawn toward the least."""
    rng = random.Random(4)
    stepped = TokenWeights()
    _batched_calls(stepped, rng, lambda read, wrote, steps: 20_000 + 1_500 * read + 60_000 * steps)
    assert stepped.per_token == 1.0
    assert 40 * 0.75 <= stepped.per_step <= 40 * 1.05
    assert stepped.alone == round(stepped.per_token + stepped.per_step, 2)
    # A model whose every new token costs alike, however many rows: no step weight.
    tokens = TokenWeights()
    _batched_calls(tokens, rng, lambda read, wrote, steps: 20_000 + 100 * (read + 10 * wrote))
    assert 10 * 0.8 <= tokens.per_token <= 10 * 1.05
    assert tokens.per_step == 0.0
    # Calls of one row cannot tell a step from a new token: folded into it.
    alone = TokenWeights()
    _calls(alone, rng, lambda read, wrote: 20_000 + 1_500 * read + 60_000 * wrote)
    assert alone.per_step == 0.0
    assert 40 * 0.85 <= alone.per_token <= 40 * 1.05
    # Held so that a new token alone weighs at most the most, the two
    # scaled alike (a GPU's prefill is nearly free: the steps still split).
    for per_token_us, per_step_us in ((1_000, 100_000), (40, 20_000)):
        dear = TokenWeights()

        def us_of(read: int, wrote: int, steps: int, t: int = per_token_us, s: int = per_step_us):
            return read / 2 + t * wrote + s * steps

        _batched_calls(dear, rng, us_of)
        assert dear.alone == wire.MOST_NEW_TOKEN_WEIGHT
        assert dear.per_step > 50 * dear.per_token


def test_a_count_no_model_made_is_held() -> None:
    """A remote server's counts are its own: one of 10**400 tokens raised in
    the split, one of 10**160 left the fit's sums infinite for good."""
    answers = Answers("w", Keys(), SimulatedBackend(0), None, None)  # type: ignore[arg-type]
    env = wire.Envelope("r", "g", "paid", "k", "a b", 0, 1)
    counted = Counted("an answer", tokens=10**400, input_tokens=10**160)
    assert answers._clipped(counted, 5) == ("an answer", MOST_COUNTED)
    assert answers._input_tokens(env, counted) == MOST_COUNTED


def test_a_step_is_shared_by_the_requests_still_writing_at_it() -> None:
    assert step_shares([64, 1, 1, 1]) == [63.25, 0.25, 0.25, 0.25]
    assert step_shares([5]) == [5.0]  # (alone: all its own steps)
    assert step_shares([0, 3, 0]) == [0.0, 3.0, 0.0]  # (a failed input wrote none)
    assert step_shares([2, 4, 4]) == pytest.approx([2 / 3, 2 / 3 + 1, 2 / 3 + 1])
    assert step_shares([]) == []
    rng = random.Random(5)
    for _ in range(100):
        wrote = [rng.randint(0, 300) for _ in range(rng.randint(1, 100))]
        assert sum(step_shares(wrote)) == pytest.approx(max(wrote))


def test_a_call_is_measured_as_the_backend_ran_it() -> None:
    """Identical inputs collapse onto one of the backend's inputs: the call
    read and wrote its tokens once. A call with an input that failed says
    nothing of what writing costs (its failed input wrote none)."""
    answers = Answers("w", Keys(), SimulatedBackend(0), None, None)  # type: ignore[arg-type]
    fit = answers.token_weights
    same = [wire.Envelope(f"r{i}", "g", "paid", "k", "a b c", 0, 1) for i in range(3)]
    other = wire.Envelope("r3", "g", "paid", "k", "d e", 0, 1)
    outcome_of: dict = {slot_key(same[0]): "sim: a b c", slot_key(other): "sim: d e"}
    answers._measure([*same, other], outcome_of, [(3, 4)] * 3 + [(2, 3)], 50_000)
    assert fit._sums[0] == [1.0, 5.0, 7.0, 4.0, 50_000.0]  # (a call of 3 + 2 in, 4 + 3 out)
    outcome_of[slot_key(other)] = BackendError("failed")
    answers._measure([*same, other], outcome_of, [(3, 4)] * 3 + [(2, 0)], 50_000)
    assert fit._sums[0][0] == 1.0  # (not measured)


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


async def _measured_round(cluster_factory, worker_args: list[str], rng: random.Random) -> dict:
    """What each key spent in a round of both keys at once (eight rows a
    call at most, 2 ms a call, 0.1 ms a token), after a round for the
    worker to fit its weights to."""
    keys = tuple(key_entry(key, "paid", f"{key}-secret") for key in KEYS)
    c = cluster_factory(
        policy_yaml(extra_keys=keys, max_batch_size=8, tiers={"paid": {"latency_budget_ms": 5000}}),
        latency_ms=2,
        worker_args=["--sim-ms-per-ktoken", "100", *worker_args],
    )
    url = c.urls[0] + "/v1/inference"
    # (a request's usage is charged in the step that answers it: read once answered)
    await _send(url, 12, rng)
    before = _usage(c.redis_url)
    await _send(url, 6, rng)
    after = _usage(c.redis_url)
    return {key: {w: after[key][w] - before[key][w] for w in after[key]} for key in KEYS}


async def test_each_key_pays_for_its_new_tokens_as_the_model_costs_them(cluster_factory) -> None:
    """A key of short prompts and long answers pays what its answers cost:
    its share of a call's time over a reader's follows their input tokens
    plus their new tokens weighed as the worker measured them (not alike:
    before, 0.2 of what the writer's requests cost)."""
    worker_args = ["--sim-new-token-weight", str(NEW_TOKEN_WEIGHT)]
    spent = await _measured_round(cluster_factory, worker_args, random.Random(5))
    paid = {key: s["gpu_us"] for key, s in spent.items()}
    cost = {
        key: s["input_tokens"] + NEW_TOKEN_WEIGHT * s["output_tokens"] for key, s in spent.items()
    }
    ratio = (paid["writer"] / paid["reader"]) / (cost["writer"] / cost["reader"])
    print(f"paid {paid}, cost in input tokens {cost}, paid over cost, writer to reader {ratio:.2f}")
    assert 0.8 <= ratio <= 1.25


# (the simulated model: 2 ms a call, 0.1 ms a token in or out, and 3 ms a
# decoding step, whatever the rows writing at it)
STEP_WEIGHT = 30.0


async def test_each_key_pays_for_the_decoding_steps_it_ran(cluster_factory) -> None:
    """On a batched engine a decoding step costs about the same for one row
    as for eight: the steps after the readers' one word run for the writers
    alone, so a reader pays for its own tokens and a share of the first
    step, not for the writers' steps (before, split by tokens alone: 1.9
    times its tokens' time; now 1.04-1.05)."""
    worker_args = ["--sim-step-weight", str(STEP_WEIGHT)]
    spent = await _measured_round(cluster_factory, worker_args, random.Random(6))
    tokens_us = {key: 100 * (s["input_tokens"] + s["output_tokens"]) for key, s in spent.items()}
    paid = {key: s["gpu_us"] for key, s in spent.items()}
    print(f"paid {paid}, their tokens' own time {tokens_us}")
    assert 1.0 <= paid["reader"] / tokens_us["reader"] <= 1.2
    # (the writers' steps are the rest of the calls' time, and theirs)
    assert paid["writer"] / tokens_us["writer"] >= 3.0


async def test_a_worker_started_beside_a_fitted_one_splits_its_first_calls_as_the_fleet(
    cluster_factory,
) -> None:
    """The first worker fits its weights from its calls and says them in
    its heartbeat; a worker of the same model started after it begins
    from them (before: one, for its first 16 calls and more)."""
    keys = tuple(key_entry(key, "paid", f"{key}-secret") for key in KEYS)
    c = cluster_factory(
        policy_yaml(extra_keys=keys, max_batch_size=8, tiers={"paid": {"latency_budget_ms": 5000}}),
        latency_ms=2,
        worker_args=["--sim-ms-per-ktoken", "100", "--sim-new-token-weight", "10"],
    )
    await _send(c.urls[0] + "/v1/inference", 14, random.Random(7))  # (some 28 calls)
    client = redis.Redis.from_url(c.redis_url)
    try:
        (first,) = client.smembers(Keys("infergate").members("worker"))
        key = Keys("infergate").heartbeat("worker", first.decode())

        def fitted() -> list[float]:
            return wire.decode_heartbeat(client.get(key)).token_weights

        said = wait_for(fitted, 10, "the first worker's weights in its heartbeat")
        assert said[0] + said[1] > 3  # (a new token costs ten input tokens' time)
        second = c.add_worker()
        wait_for(lambda: "worker.token_weights_adopted" in second.output(), 30, "the adoption")
        lines = [json.loads(t) for t in second.output().splitlines() if t.startswith("{")]
        adopted = next(ln for ln in lines if ln["event"] == "worker.token_weights_adopted")
        assert [adopted["new_token_weight"], adopted["step_weight"]] == fitted()
        # The first worker gone, the second's first calls split as it did.
        c.workers[0].stop()
        await _send(c.urls[0] + "/v1/inference", 2, random.Random(8))
        lines = [json.loads(t) for t in second.output().splitlines() if t.startswith("{")]
        first_calls = [ln["new_token_weight"] for ln in lines if ln["event"] == "batch.done"]
        assert first_calls
        assert set(first_calls) == {min(round(said[0] + said[1], 2), 64.0)}
    finally:
        client.close()
