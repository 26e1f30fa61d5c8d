"""The studies' harness: a baseline and a candidate measured alternately after the
warm-up, the ratio the median of the rounds' own ratios, the JSON as reported."""

from __future__ import annotations

import json

from splitserve.bench import harness


def test_paired_alternates_after_the_warm_up_and_takes_the_median_round_ratio():
    calls = []
    base = iter([9.0, 10.0, 20.0, 10.0])  # the first is the warm-up's
    cand = iter([1.0, 5.0, 30.0, 40.0])

    def baseline() -> float:
        calls.append("b")
        return next(base)

    def candidate() -> float:
        calls.append("c")
        return next(cand)

    pair = harness.paired(baseline, candidate, rounds=3, warmup=1)
    assert calls == ["b", "c"] * 4
    assert pair.baseline == [10.0, 20.0, 10.0] and pair.candidate == [5.0, 30.0, 40.0]
    assert pair.ratio == 1.5  # the rounds' ratios are 0.5, 1.5, 4.0


def test_report_writes_the_ratio_and_the_figures(tmp_path, capsys):
    path = tmp_path / "out.json"
    harness.report("served / offline", 0.8391, str(path), model="smollm2", served_tps=12.5)
    assert "served / offline = 0.839x" in capsys.readouterr().out
    assert json.loads(path.read_text()) == {
        "what": "served / offline",
        "ratio": 0.8391,
        "model": "smollm2",
        "served_tps": 12.5,
    }


def test_table_aligns_names_left_and_figures_right():
    text = harness.table(["path", "tok/s"], [["offline", 101.234], ["served", 9.5]])
    assert text.splitlines() == ["path      tok/s", "offline  101.23", "served     9.50"]
