"""The simulated backend's cost that grows with what a batch reads and
writes (``--sim-ms-per-kchar``): a batch of long inputs takes longer than
one of short ones, as a real model's prefill and decode do."""

import time

import pytest
from infergate.gpu.backends.simulated import SimulatedBackend, sim_output


def _took_s(backend: SimulatedBackend, inputs: list[str]) -> float:
    started = time.monotonic()
    backend.infer(inputs)
    return time.monotonic() - started


def test_a_batch_takes_its_time_and_more_per_character_in_and_out() -> None:
    backend = SimulatedBackend(latency_ms=10, ms_per_kchar=100)
    inputs = ["x" * 500, "y" * 500]
    chars = 1000 + sum(len(sim_output(s)) for s in inputs)  # (some 2,000 in all)
    assert _took_s(backend, inputs) >= 0.010 + chars * 100 / 1e6
    assert _took_s(backend, ["z"]) < 0.010 + chars * 100 / 1e6  # (a short one: near its base)
    assert _took_s(SimulatedBackend(latency_ms=0), inputs) < 0.1  # (none by default)


def test_a_cost_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="ms_per_kchar"):
        SimulatedBackend(ms_per_kchar=-1)
