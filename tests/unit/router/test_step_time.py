"""The decode step-time line that TPOT-based admission and the planner fit."""

import pytest

from splitserve.router.step_time import StepTimes, fit_line


def test_fit_line_recovers_a_step_time_line():
    a, b = fit_line([(1, 0.011), (8, 0.018), (32, 0.042)])
    assert a == pytest.approx(0.010, abs=1e-4) and b == pytest.approx(0.001, abs=1e-5)
    a1, b1 = fit_line([(4, 0.02), (4, 0.02)])  # one batch size: a conservative split
    assert a1 + 4 * b1 == pytest.approx(0.02) and b1 > 0


def line(batch: float) -> float:
    return 0.010 + 0.002 * batch


def test_largest_batch_whose_step_fits_the_target():
    steps = StepTimes()
    assert steps.largest_batch(0.05) is None  # nothing measured: no cap
    for batch in (1, 4, 8, 16):
        steps.add(batch, line(batch))
    assert steps.largest_batch(line(10)) == 10
    assert steps.largest_batch(line(10) - 1e-4) == 9
    assert steps.largest_batch(0.005) == 1  # not even one fits: one at a time, never none


def test_with_one_batch_size_measured_the_batch_grows_a_step_at_a_time():
    steps = StepTimes()
    steps.add(0, 0.0)  # no decode step yet
    steps.add(3, line(3))
    assert len(steps) == 1
    assert steps.largest_batch(line(3)) == 4  # the slope is unknown: one more, then measure
    assert steps.largest_batch(line(2)) == 2  # over the target already: one less


def test_sizes_not_reported_for_a_while_no_longer_count():
    now = [0.0]
    steps = StepTimes(weight=1.0, max_age_s=30, clock=lambda: now[0])  # each report replaces its bin
    for batch in (1, 2, 3, 4, 5, 6):  # under a heavy load: 10 ms per sequence more
        steps.add(batch, 0.010 + 0.010 * batch)
    assert steps.largest_batch(0.040) == 3
    now[0] = 20.0
    for batch in (1, 2, 3):  # the load is gone, the steps are cheap again
        steps.add(batch, line(batch))
    assert steps.largest_batch(0.040) == 3  # the old sizes still weigh
    now[0] = 40.0
    for batch in (1, 2, 3):
        steps.add(batch, line(batch))
    assert len(steps) == 3  # 1, 2, 3: the sizes 4-6 of the heavy load are gone
    assert steps.largest_batch(line(12)) == 12


def test_a_worker_held_at_its_cap_keeps_the_slope_it_measured_before():
    steps = StepTimes()
    for batch in (1, 2, 4, 8):
        steps.add(batch, line(batch))
    for _ in range(500):  # long at one size: its bin moves, the others stay
        steps.add(6, line(6))
    assert len(steps) == 5
    assert steps.largest_batch(line(12)) == 12


def test_a_noisy_bin_does_not_hold_the_cap_below_sizes_that_met_the_target():
    steps = StepTimes()
    steps.add(3, 0.015)
    steps.add(4, 0.021)  # noise: a steep slope between two neighbours
    assert steps.largest_batch(0.022) == 4  # 4 was measured within the target


def test_a_step_that_does_not_grow_with_the_batch_is_not_capped():
    steps = StepTimes()
    for batch in (1, 8, 32):
        steps.add(batch, 0.02)
    assert steps.largest_batch(0.05) is None
    assert steps.largest_batch(0.01) == 1
