"""The worker's model of its batch time: fitted to what it measured, it
predicts a full batch and bounds a call (gpu/batch_time.py)."""

import pytest
from infergate.gpu.batch_time import RECENT_CALLS, REFIT_EVERY, BatchTimes, fit

# SmolLM2-135M on this repository's 2-core CPU: (inputs, characters, ms)
# (docs/performance.md, "Several models").
CPU = [
    (1, 30, 434), (4, 120, 879), (16, 480, 1193), (32, 960, 1620), (64, 1920, 2635),
    (1, 500, 717), (4, 2000, 1277), (16, 8000, 3105), (32, 16000, 5960), (64, 32000, 11957),
]  # fmt: skip


def test_a_constant_batch_time_is_its_own_model() -> None:
    a, b, c = fit([(1, 9, 100.0), (100, 51_200, 100.0), (7, 300, 100.0)])
    assert a == pytest.approx(100.0, rel=1e-3)
    assert b == pytest.approx(0.0, abs=1e-3)
    assert c == pytest.approx(0.0, abs=1e-3)


def test_a_cpu_models_batches_are_predicted_within_a_third() -> None:
    a, b, c = fit(CPU)
    for n, chars, ms in CPU:
        assert a + b * n + c * chars == pytest.approx(ms, rel=0.35)


def test_small_batches_of_late_do_not_hide_what_a_full_one_takes() -> None:
    times = BatchTimes(hang_floor_ms=2_000)
    for n, chars, ms in ((1, 7, 434.0), (64, 448, 2_635.0), (64, 32_768, 11_957.0)):
        times.anchor(n, chars, ms)  # the warm-up
    for _ in range(40):
        times.took(1, 30, 434.0)  # low load: one short input at a time
    # A full batch of 30-character inputs took 2,635 ms (not 434, nor 64 x 434).
    assert times.full_batch_ms(64) == pytest.approx(2_635, rel=0.2)


def test_a_call_is_hung_only_past_four_times_what_it_should_take() -> None:
    times = BatchTimes(hang_floor_ms=2_000)
    assert times.hang_timeout_ms(1, 10) == 2_000  # nothing measured: the floor
    times.anchor(1, 10, 100.0)
    times.anchor(100, 51_200, 100.0)
    assert times.hang_timeout_ms(100, 400_000) == 2_000  # a fast model: still the floor
    for n, chars, ms in CPU:
        times.took(n, chars, ms)
    assert times.hang_timeout_ms(64, 32_000) >= 4 * 11_957


def test_a_long_call_stretches_the_hang_timeout_only_while_it_is_recent() -> None:
    times = BatchTimes(hang_floor_ms=2_000)
    times.anchor(1, 10, 100.0)
    times.took(1, 10, 5_000.0)  # one slow call (a GC pause, a cold kernel)
    assert times.hang_timeout_ms(1, 10) == 20_000
    for _ in range(RECENT_CALLS):
        times.took(1, 10, 100.0)
    assert times.hang_timeout_ms(1, 10) == 2_000


def test_a_full_record_is_fitted_again_every_few_calls_not_after_each() -> None:
    times = BatchTimes(hang_floor_ms=1)
    for _ in range(RECENT_CALLS):
        times.took(1, 10, 100.0)
    assert times.predict_ms(1, 10) == pytest.approx(100.0, rel=0.01)
    for _ in range(REFIT_EVERY - 1):
        times.took(1, 10, 200.0)
    assert times.predict_ms(1, 10) == pytest.approx(100.0, rel=0.01)  # the fit kept
    times.took(1, 10, 200.0)
    assert times.predict_ms(1, 10) > 105.0  # made again with the slower calls
    assert times.slowest_ms == 200.0  # (the slowest call is always current)
