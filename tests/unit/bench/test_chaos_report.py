"""The chaos report's goals: requests the router ends at two worker losses are counted
apart from the completion goal, and each must name two workers that two different
kills took down; any other INTERNAL is a problem."""

from __future__ import annotations

from splitserve.bench.chaos import TWO_LOSSES, ChaosReport, Kill, Outcome

KILLS = [Kill(1.0, "decode", ("decode-0",)), Kill(2.0, "node", ("prefill-1", "decode-1"), "n1")]


def _twice(workers: str) -> tuple[str, str]:
    return "INTERNAL", f"the request was on 2 {TWO_LOSSES} ({workers}), so it is not tried again (fp ab)"


def _report(codes: list[tuple[str, str]]) -> ChaosReport:
    outcomes = [Outcome(i, code, message, (), 0.1) for i, (code, message) in enumerate(codes)]
    return ChaosReport(outcomes, KILLS, [], {}, {}, 1.0)


def test_two_loss_endings_are_counted_apart_when_two_kills_explain_them():
    ok = [("OK", "")] * 20
    report = _report(ok + [_twice("decode-0, decode-1")] * 3 + [_twice("decode-0, prefill-1")])
    assert report.ended_at_two_losses == 4 and report.completed == 1.0 and report.problems() == []


def test_two_loss_endings_no_two_kills_explain_are_problems():
    ok = [("OK", "")] * 20
    # one kill counted twice (prefill-1 and decode-1 went down together), and a worker never killed
    for workers in ("prefill-1, decode-1", "decode-0, decode-7", "decode-0"):
        (problem,) = _report(ok + [_twice(workers)]).problems()
        assert "no two kills explain" in problem and workers in problem


def test_other_internal_errors_are_problems():
    report = _report([("OK", "")] * 98 + [("INTERNAL", "internal error (KeyError); see the server log")] * 2)
    assert report.completed < 0.99 and len(report.problems()) == 2
