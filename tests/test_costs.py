"""The measured cost model a gateway keeps (gateway/costs.py): the line a
GPU budget's reservation is drawn from (gateway/reservations.py), fitted to
calls' measured time against their tokens, whose calls move it, and what it
bounds: nothing larger than it has seen, nothing slower than it has seen."""

from collections import OrderedDict
from types import SimpleNamespace

import pytest
from infergate.base import wire
from infergate.gateway.costs import RECENT_CALLS, CostModel, MeasuredCall
from infergate.gateway.jobs import Jobs
from infergate.gateway.reservations import (
    GPU_MARGIN,
    GPU_UNKNOWN_US,
    MOST_AMOUNT,
    gpu_bound,
    gpu_job_bound,
    gpu_least,
    gpu_used,
    used,
)


def answer(costs: CostModel, key_id: str, calls: int, fixed_us: float, per_token_us: float) -> None:
    """``calls`` answers of the key's, each alone in a call of 10-40 tokens."""
    for i in range(calls):
        tokens = 10 + i % 31
        call_us = round(fixed_us + per_token_us * tokens)
        costs.answered(key_id, 20, call_us, MeasuredCall("", tokens, call_us), (tokens - 4, 4))


def fitted(costs: CostModel, key_id: str) -> tuple[float, float]:
    line = costs.call_line(key_id)
    assert line is not None
    return line.fit() or (0.0, 0.0)


def test_the_line_is_fitted_to_the_calls_measured() -> None:
    costs = CostModel()
    assert costs.call_line("a") is None
    answer(costs, "a", 50, 20_000, 500)
    fixed_us, per_token_us = fitted(costs, "a")
    assert fixed_us == pytest.approx(20_000, rel=0.01)
    assert per_token_us == pytest.approx(500, rel=0.01)


def test_another_keys_calls_do_not_move_a_keys_line() -> None:
    """Key b's calls, ten times slower a token, move neither key a's line
    nor the least its reservation is cut to; a key with no call measured
    has no line, and its least is the fleet's slowest batch (a tenth of a
    second before one is measured)."""
    costs = CostModel()
    answer(costs, "a", 40, 20_000, 500)
    answer(costs, "b", 400, 20_000, 5_000)
    assert fitted(costs, "a") == pytest.approx((20_000, 500), rel=0.01)
    assert fitted(costs, "b") == pytest.approx((20_000, 5_000), rel=0.01)
    assert costs.call_line("unseen") is None
    line = costs.call_line("a")
    assert line is not None
    bound = gpu_bound(36, 4, line)  # (a call of 41: past the last calls', in proportion)
    assert gpu_least(line, 10_000.0) == bound < GPU_MARGIN * 1.01 * 40_500 * 41 / line.largest_call
    assert gpu_least(None, 400.0) == round(GPU_MARGIN * 400_000)
    assert gpu_least(None, 0.0) == round(GPU_MARGIN * 100_000)


def test_calls_of_one_size_cannot_train_a_line_below_a_calls_time() -> None:
    """A key that sends only calls of one size gets a line whose bound for
    a one-token request is still a whole call's time (a line with no fixed
    part let tiny jobs reserve a sixth of what they then used)."""
    costs = CostModel()
    for _ in range(20):
        costs.answered("a", 4000, 50_000, MeasuredCall("", 900, 50_000), (896, 4))
    fixed_us, _ = fitted(costs, "a")
    assert fixed_us == pytest.approx(50_000)
    assert gpu_bound(1, 1, costs.call_line("a")) >= GPU_MARGIN * 49_999


def test_calls_of_one_size_bound_a_request_of_as_many_bytes_and_more_tokens() -> None:
    """Calls of one size measured no part per token: a key that trained
    its line on one-word inputs of 400 bytes (4 tokens a call), then sends
    400 one-byte words in as many bytes, reserves at least what their call
    takes on a model of 20 ms a call and 1 ms a token (drawn from the mean
    call alone, it reserved 36 ms of a 438 ms call: emoji then ASCII spent
    1.4x a budget)."""
    costs = CostModel()
    for _ in range(20):
        costs.answered("a", 400, 24_000, MeasuredCall("", 4, 24_000), (416, 1))
    line = costs.call_line("a")
    assert gpu_bound(416, 1, line) >= 20_000 + 1_000 * (1 + 416 + 1)
    assert gpu_bound(2, 1, line) == round(GPU_MARGIN * 24_000)  # (fewer: the mean call's)


def test_a_slope_of_noise_is_not_carried_past_the_calls_measured() -> None:
    """Calls of 3 and 4 tokens on a busy machine (a slope of 0.1 ms a token
    fitted on a model of 0.4): past the largest call, a request of 418
    tokens' bound reserves at least what it takes (drawn from the line's
    slope, 1.8-2.9x under in some trainings)."""
    costs = CostModel()
    for i in range(40):
        tokens = 3 + i % 2
        call_us = 22_000 + 100 * (tokens - 3)
        costs.answered("a", 400, call_us, MeasuredCall("", tokens, call_us), (416, 1))
    line = costs.call_line("a")
    assert line is not None
    assert 0 < fitted(costs, "a")[1] < 400
    assert gpu_bound(416, 1, line) >= 20_000 + 400 * 418


def test_a_size_the_sums_forgot_is_not_bounded_by_them() -> None:
    """One large call, then thousands of tiny ones until the sums forget
    it: a large request is drawn from the sizes the line remembers, in
    proportion (the largest call kept for good let it be drawn from the
    tiny calls' mean, 17x under), on a model of 20 ms and 0.4 ms a token."""
    costs = CostModel()
    costs.answered("a", 1999, 820_400, MeasuredCall("", 2001, 820_400), (2015, 1000))
    for _ in range(3000):
        costs.answered("a", 1, 21_200, MeasuredCall("", 3, 21_200), (17, 1))
    assert gpu_bound(2015, 1000, costs.call_line("a")) >= 820_400


def test_a_size_below_the_calls_measured_is_held_to_the_smallest() -> None:
    """Calls of 1,980 and 2,000 tokens on a busy machine (a key's bursts
    of a hundred requests, on a model of 100 ms and 0.05 ms a token): the
    slope of noise between them puts the line's fixed part at none, and a
    short request alone reserved a fifth of its call; below the calls
    measured, it is held to the line at the smallest."""
    costs = CostModel()
    for i in range(40):
        tokens, call_us = (1_980, 195_000) if i % 2 else (2_000, 205_000)
        costs.answered("a", 20, call_us, MeasuredCall("", tokens, call_us), (28, 16))
    assert fitted(costs, "a")[0] == 0.0
    assert gpu_bound(28, 16, costs.call_line("a")) >= 100_000 + 50 * 45


def test_a_request_far_larger_than_any_measured_is_not_estimated() -> None:
    """Short calls measured, a request of up to twice the input or output
    of the largest measured reserves that one's estimate in proportion;
    past that, ``GPU_UNKNOWN_US`` (what is left of its budget): the line
    was not fitted there (a key that trained it on short calls overspent
    its budget 1.2x with long ones at once; one that measured only short
    answers has not measured a long one). Before any call, the same."""
    costs = CostModel()
    assert gpu_bound(6, 4, costs.call_line("a")) == GPU_UNKNOWN_US
    answer(costs, "a", 40, 20_000, 10)  # (calls of 10-40 tokens, nearly all fixed)
    line = costs.call_line("a")
    assert line is not None
    largest = int(line.largest_input)  # (36, the last calls' 6-14 since)
    assert gpu_bound(largest, 4, line) < 2 * GPU_MARGIN * (20_000 + 10 * 41)
    assert GPU_UNKNOWN_US > gpu_bound(2 * largest, 4, line) >= 1.9 * gpu_bound(largest, 4, line)
    assert gpu_bound(2 * largest + 2, 4, line) == GPU_UNKNOWN_US
    # (answers of 4 tokens measured: one of 9 has not been)
    assert gpu_bound(largest, 8, line) >= 1.9 * gpu_bound(largest, 4, line)
    assert gpu_bound(10, 9, line) == GPU_UNKNOWN_US


def test_calls_over_the_line_raise_what_it_reserves_for_calls_like_them() -> None:
    """Calls alternately four times as slow (a line fitted through their
    middle, margin and all, is under them): the reservation covers the
    slow ones, and comes back down as calls keep to the line."""
    costs = CostModel()
    for i in range(40):
        tokens = 10 + 10 * (i % 4)
        call_us = 100 * tokens * (4 if i % 8 < 4 else 1)
        costs.answered("a", 20, call_us, MeasuredCall("", tokens, call_us), (tokens - 4, 4))
    line = costs.call_line("a")
    assert line is not None
    fixed_us, per_token_us = line.fit() or (0.0, 0.0)
    for tokens in (10, 20, 30, 40):
        assert GPU_MARGIN * (fixed_us + per_token_us * tokens) < 400 * tokens  # (the margin alone)
        assert gpu_bound(tokens - 5, 4, line) >= 400 * tokens
    raised = line.over
    answer(costs, "a", 400, 0, 100)
    assert 1.0 <= line.over < 1 + (raised - 1) / 10


def test_a_job_larger_than_any_request_measured_reserves_in_proportion() -> None:
    """A job teaches no line: beyond the largest request measured it
    reserves that one's estimate in proportion to its tokens, however far
    (what a short-call line's part per token would not cover); before any
    of its key's requests is measured, what is left (a fleet's batch, which
    another key's short requests set, let long jobs spend 1.6x a budget)."""
    costs = CostModel()
    assert gpu_job_bound(6, 4, costs.call_line("a")) == GPU_UNKNOWN_US
    answer(costs, "a", 40, 20_000, 10)  # (calls of 10-40 tokens, nearly all fixed)
    line = costs.call_line("a")
    assert gpu_job_bound(36, 4, line) == gpu_bound(36, 4, line)
    assert gpu_job_bound(3_600, 4, line) == pytest.approx(100 * gpu_bound(36, 4, line), rel=0.01)
    assert gpu_job_bound(3_600, 4, line) > 50 * 20_400


def test_a_long_answer_reserves_what_its_new_tokens_cost() -> None:
    """A worker that weighs a new token as ten input tokens reports its
    calls in those units: a request of a few input tokens and a long answer
    reserves what its call takes (its tokens counted alike, a fifth)."""
    costs, weight = CostModel(), 10.0
    for i in range(40):  # (alone in calls of 8-48 tokens in, 4-44 out)
        read, wrote = 8 + i, 4 + i
        tokens = round(1 + read + weight * wrote)
        call_us = 20_000 + 100 * tokens
        costs.answered("a", 40, call_us, MeasuredCall("", tokens, call_us, weight), (read, wrote))
    line = costs.call_line("a")
    assert line is not None
    assert line.new_token_weight == weight
    takes_us = 20_000 + 100 * (1 + 10 + weight * 40)
    assert takes_us <= gpu_bound(10, 40, line) <= GPU_MARGIN * 1.01 * takes_us
    # A call from a worker just started (it weighs one, until it fits its
    # own) moves the weight a bound is drawn by only as the line forgets.
    costs.answered("a", 40, 1, MeasuredCall("", 10, 1), (1, 1))
    assert line.new_token_weight == pytest.approx(1 + 9 * 0.99)
    assert gpu_bound(10, 40, line) >= 0.99 * takes_us
    # A weight from a planted reply is held to its bounds.
    costs.answered("a", 40, 1, MeasuredCall("", 10, 1, 1e9), (1, 1))
    assert line.new_token_weight == wire.MOST_NEW_TOKEN_WEIGHT


def test_a_call_is_added_once_however_many_of_the_keys_requests_it_answered() -> None:
    """A key's batch of a hundred requests is one call on its line: the
    calls before it are not forgotten a hundred times over, and the
    requests' bounds all count."""
    once, each = CostModel(), CostModel()
    for costs, batch_id in ((once, "b2"), (each, "")):
        for _ in range(40):
            costs.answered("a", 20, 1_000, MeasuredCall("b1", 40, 30_000), (30, 8))
        for i in range(100):  # (one call of 100 requests, twice as slow)
            costs.answered("a", 20, 600, MeasuredCall(batch_id, 1_000, 60_000), (8, 2 + i))
    line_once, line_each = once.call_line("a"), each.call_line("a")
    assert line_once is not None
    assert line_each is not None
    assert line_once.sums[0] == pytest.approx(1 + 0.99)  # (b1, then b2: two calls)
    assert line_each.sums[0] > 60  # (each answer a call: b1 nearly forgotten)
    assert line_once.largest_output == 101


def test_a_call_read_again_among_others_is_not_added_again() -> None:
    """Answers of calls that interleave (a late reply's, jobs read in turn)
    add each call once while it is among the line's recent calls."""
    costs = CostModel()
    for _ in range(50):
        for batch_id in ("b1", "b2"):
            costs.answered("a", 20, 1_000, MeasuredCall(batch_id, 40, 30_000), (30, 8))
    line = costs.call_line("a")
    assert line is not None
    assert line.sums[0] == pytest.approx(1.99)
    for i in range(RECENT_CALLS):
        costs.learned("a", MeasuredCall(f"c{i}", 40, 30_000), (30, 8))
    costs.learned("a", MeasuredCall("b1", 40, 30_000), (30, 8))  # (forgotten: a call again)
    assert line.sums[0] == pytest.approx(sum(0.99**i for i in range(RECENT_CALLS + 3)))


def test_a_job_read_again_teaches_its_keys_line_once() -> None:
    """However often, and in whatever turn, its owner reads a finished job,
    its gateway learns its call once (reads cost nothing: a client reading
    two cheap jobs in turn had each read add a call, its line drawn down)."""
    costs = CostModel()
    lane = SimpleNamespace(quota=SimpleNamespace(costs=costs))
    lanes = SimpleNamespace(of_key=lambda name, key_id: lane if name == "default" else None)
    jobs = Jobs.__new__(Jobs)  # (what _learn reads of it: its gateway's lanes)
    jobs.gateway, jobs._learned = SimpleNamespace(lanes=lanes), OrderedDict()
    record = {"model": "default", "input_bound": "30"}
    # (more jobs than the calls a line knows it added: the gateway's own
    # record of the jobs it learned from is what keeps a call from coming back)
    results = {
        f"j{i}": wire.Result(f"j{i}", f"batch-{i}", 1, "w", 0, 30, "x", call_tokens=40)
        for i in range(RECENT_CALLS + 6)
    }
    for _ in range(5):
        for job_id, result in results.items():
            jobs._learn(job_id, "a", record, result)
    line = costs.call_line("a")
    assert line is not None
    once = sum(0.99**i for i in range(len(results)))
    assert line.sums[0] == pytest.approx(once)
    jobs._learn("new", "a", {"input_bound": "30"}, results["j1"])  # (no model: none learned)
    jobs._learn("new", "a", {**record, "model": "gone"}, results["j1"])
    assert line.sums[0] == pytest.approx(once)


def test_a_planted_call_neither_teaches_a_line_nor_overflows_a_budget() -> None:
    """A result planted in Redis (a job's record) saying its call took 2^63
    ms is no call a worker measured: the line ignores it; and whatever a
    reservation or a settlement comes to, it stays within what the budget
    scripts count (a 23-digit reservation read as none let a key's GPU
    budget go unmetered, and its give-back reset the period's spending)."""
    costs = CostModel()
    answer(costs, "a", 40, 20_000, 500)
    line = costs.call_line("a")
    assert line is not None
    before = list(line.sums)
    costs.learned("a", MeasuredCall("planted", 40, 2**63 * 1000), (30, 8))
    costs.learned("a", MeasuredCall("planted2", 2**63, 30_000), (30, 8))
    assert line.sums == before
    line.over = 1e30  # (however far over its line a key's calls went)
    assert gpu_bound(30, 8, line) == MOST_AMOUNT
    planted = wire.Result(
        "r", "b", 1, "w", 0, 1, "x", tokens=2**62, input_tokens=2**62, gpu_us=2**63 - 1
    )
    assert used(planted, 10) == MOST_AMOUNT
    assert gpu_used(planted) == MOST_AMOUNT
