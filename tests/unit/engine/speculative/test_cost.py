"""``speculative.cost.StepCost``: a draft token's price, fitted to the decode steps."""

from __future__ import annotations

import pytest

from splitserve.engine.speculative.cost import PRIOR_ROW_COST, StepCost


def test_the_row_cost_is_the_fitted_slope_over_a_tokens_seconds():
    cost = StepCost()
    for i in range(40):  # 8 sequences; 10 ms a step plus 1 ms per row
        rows = 8 + (i % 4) * 3
        cost.stepped(0.010 + 0.001 * rows, rows, 8)
    token_s = cost.token_s
    assert 0.010 / 8 < token_s < 0.030 / 8
    assert cost.row_cost == pytest.approx(0.001 / token_s, rel=1e-6)


def test_steps_of_one_size_leave_the_prior_and_a_free_row_costs_nothing():
    cost = StepCost()
    for _ in range(20):
        cost.stepped(0.02, 4, 4)
    assert cost.row_cost == PRIOR_ROW_COST
    for i in range(40):
        cost.stepped(0.02, 4 + i % 5, 4)  # rows do not change the time
    assert cost.row_cost == pytest.approx(0.0, abs=1e-9)


def test_a_proposer_as_slow_as_the_step_costs_a_whole_token():
    cost = StepCost()
    for _ in range(10):
        cost.stepped(0.05, 1, 1)
        cost.proposed(0.05)
    assert cost.proposer_cost == pytest.approx(1.0)
    assert cost.min_gain == pytest.approx(PRIOR_ROW_COST + 1.0)


def test_a_fit_outlives_the_spread_that_made_it():
    """A probe step now and then varies the rows less than the decay forgets: the row
    cost stays the last fit, never falls back to the prior (which on a CPU is a
    fraction of the true cost)."""
    cost = StepCost()
    for i in range(40):  # drafts every other step: 1 ms a row fits
        rows = 16 + (i % 2) * 13
        cost.stepped(0.010 + 0.001 * rows, rows, 16)
    fitted = cost.row_cost
    assert fitted == pytest.approx(0.001 / cost.token_s, rel=1e-6)
    for _ in range(200):  # then plain decode steps only
        cost.stepped(0.026, 16, 16)
    assert cost.row_cost == pytest.approx(0.001 / cost.token_s, rel=1e-6) != PRIOR_ROW_COST
