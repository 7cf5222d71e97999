"""The measured cost model a gateway keeps (gateway/costs.py): the line a
GPU budget's reservation is drawn from, fitted to calls' measured time
against their tokens, and whose calls move it."""

import pytest
from infergate.gateway.costs import OWN_CALLS, CostModel


def answer(costs: CostModel, key_id: str, calls: int, fixed_us: float, per_token_us: float) -> None:
    """``calls`` answers of the key's, each alone in a call of 10-40 tokens."""
    for i in range(calls):
        tokens = 10 + i % 31
        call_us = round(fixed_us + per_token_us * tokens)
        costs.answered(key_id, 20, call_us, tokens, call_us)


def test_the_line_is_fitted_to_the_calls_measured() -> None:
    costs = CostModel()
    assert costs.call_line() is None
    answer(costs, "a", 50, 20_000, 500)
    fixed_us, per_token_us = costs.call_line("a") or (0, 0)
    assert fixed_us == pytest.approx(20_000, rel=0.01)
    assert per_token_us == pytest.approx(500, rel=0.01)


def test_another_keys_calls_move_only_the_line_of_keys_without_their_own() -> None:
    """Key b's calls, ten times slower a token, pull every key's line up;
    key a, with calls of its own, keeps its line; a key with fewer than
    OWN_CALLS calls gets the line of every key's calls."""
    costs = CostModel()
    answer(costs, "a", 40, 20_000, 500)
    answer(costs, "few", int(OWN_CALLS) - 2, 20_000, 500)
    answer(costs, "b", 400, 20_000, 5_000)
    assert costs.call_line("a") == pytest.approx((20_000, 500), rel=0.01)
    assert costs.call_line("few") == costs.call_line() == costs.call_line("unseen")
    _, everyones_per_token = costs.call_line() or (0, 0)
    assert everyones_per_token > 4 * 500


def test_calls_of_one_size_cannot_train_a_line_below_a_calls_time() -> None:
    """A key that sends only calls of one size gets a line whose bound for
    a one-token request is still a whole call's time (a line with no fixed
    part let tiny jobs reserve a sixth of what they then used)."""
    costs = CostModel()
    for _ in range(20):
        costs.answered("a", 4000, 50_000, 900, 50_000)
    fixed_us, per_token_us = costs.call_line("a") or (0, 0)
    assert fixed_us + per_token_us * 2 >= 50_000
