"""The elastic simulator check's arithmetic: the time-weighted mean of the prefill
workers over a run, from the role changes a bench run recorded."""

from __future__ import annotations

import pytest

from splitserve.bench.elastic_sim import Prediction, error, mean_prefill


def test_the_mean_prefill_workers_weighs_each_split_by_how_long_it_held():
    # 0:2 from the start (sampled first at 0.4 s), 1:1 from 10 s, 0:2 from 30 s, run of 40 s
    changes = [[0.4, 0, 2], [10.0, 1, 1], [30.0, 0, 2]]
    assert mean_prefill(changes, 40.0) == pytest.approx(20 / 40)
    assert mean_prefill(changes, 20.0) == pytest.approx(10 / 20)  # the run ended at 20 s
    assert mean_prefill([], 40.0) == 0.0


def test_the_error_is_the_worse_of_split_and_goodput():
    assert error(Prediction(1, 0.5, 0.6, 1.0, 0.9)) == pytest.approx(0.2)
    assert error(Prediction(1, 0.0, 0.1, 1.0, 1.0)) == pytest.approx(0.1)  # none measured: the simulated
