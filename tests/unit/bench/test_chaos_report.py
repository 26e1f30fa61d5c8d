"""The chaos report's goals: requests the router ends at two worker losses are counted
apart from the completion goal, and bounded themselves; any other INTERNAL is a problem."""

from __future__ import annotations

from splitserve.bench.chaos import TWO_LOSSES, ChaosReport, Outcome

TWICE = f"the request was on 2 {TWO_LOSSES}, so it is not tried on another (fingerprint ab)"


def _report(codes: list[tuple[str, str]]) -> ChaosReport:
    outcomes = [Outcome(i, code, message, (), 0.1) for i, (code, message) in enumerate(codes)]
    return ChaosReport(outcomes, [], [], {}, {}, 1.0)


def test_two_loss_endings_are_counted_apart_and_bounded():
    ok = [("OK", "")] * 98
    report = _report(ok + [("INTERNAL", TWICE)] * 2)
    assert report.ended_at_two_losses == 2 and report.completed == 1.0 and report.problems() == []
    report = _report(ok + [("INTERNAL", TWICE)] * 3)
    assert report.problems() == ["3 requests ended at two worker losses (goal: 2 % at most)"]
    report = _report(ok + [("INTERNAL", "internal error (KeyError); see the server log")] * 2)
    assert report.completed < 0.99 and len(report.problems()) == 2
