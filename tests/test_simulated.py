"""The simulated backend's cost that grows with the tokens a batch reads
and writes (``--sim-ms-per-ktoken``; its tokens are words): a batch of
long inputs takes longer than one of short ones, as a real model's prefill
and decode do, and a long word costs what a short one does, so the tokens
the worker splits a call's time by are what its time follows."""

import time

import pytest
from infergate.gpu.backend import Prompts
from infergate.gpu.backends.simulated import SimulatedBackend, sim_output


def _took_s(backend: SimulatedBackend, inputs: list[str]) -> float:
    started = time.monotonic()
    backend.infer(inputs)
    return time.monotonic() - started


def test_a_batch_takes_its_time_and_more_per_token_in_and_out() -> None:
    backend = SimulatedBackend(latency_ms=10, ms_per_ktoken=200)
    inputs = ["x " * 250, "y " * 250]
    tokens = 500 + sum(len(sim_output(s).split()) for s in inputs)  # (some 1,000 in all)
    assert _took_s(backend, inputs) >= 0.010 + tokens * 200 / 1e6
    assert _took_s(backend, ["z" * 500]) < 0.010 + tokens * 200 / 1e6  # (one word: near its base)
    assert _took_s(SimulatedBackend(latency_ms=0), inputs) < 0.1  # (none by default)


def test_it_stops_at_each_inputs_max_tokens_and_pays_only_for_those() -> None:
    backend = SimulatedBackend(latency_ms=0, ms_per_ktoken=1000)
    inputs = ["a " * 400, "b c d"]
    prompts = Prompts(inputs, inputs, max_tokens=[2, 0])
    started = time.monotonic()
    outputs = backend.infer(prompts)
    took_s = time.monotonic() - started
    assert outputs == [" ".join(sim_output(inputs[0]).split()[:2]), sim_output("b c d")]
    assert 0.409 <= took_s < 0.409 + 0.3  # (400 and 3 words in, 2 and 4 out: a ms each)


def test_a_cost_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="ms_per_ktoken"):
        SimulatedBackend(ms_per_ktoken=-1)


def test_a_token_out_costs_its_weight_in_tokens_in() -> None:
    backend = SimulatedBackend(latency_ms=0, ms_per_ktoken=1000, new_token_weight=50)
    prompts = Prompts(["a b c"], ["a b c"], max_tokens=[2])
    started = time.monotonic()
    backend.infer(prompts)
    assert time.monotonic() - started >= 0.003 + 50 * 0.002  # (3 words in, 2 out)
    for weight in (0.5, float("nan"), 1001):
        with pytest.raises(ValueError, match="new_token_weight"):
            SimulatedBackend(new_token_weight=weight)


def test_a_decoding_step_costs_its_weight_once_for_the_whole_batch() -> None:
    backend = SimulatedBackend(latency_ms=0, ms_per_ktoken=1000, step_weight=100)
    prompts = Prompts(["a b", "c d"], ["a b", "c d"], max_tokens=[1, 3])
    started = time.monotonic()
    backend.infer(prompts)
    # (4 words in, 1 + 3 out, and 3 steps for the two rows together)
    assert time.monotonic() - started >= 0.008 + 100 * 0.003
    for weight in (-1, float("nan"), 1001):
        with pytest.raises(ValueError, match="step_weight"):
            SimulatedBackend(step_weight=weight)
