"""A decode worker's step time as a line in its batch size, fitted from what it reports.

A decode step's time grows about linearly with the sequences in the batch
(``t = a + b * batch``: weights are read once per step, attention and sampling
per sequence). ``StepTimes`` keeps one worker's step time per batch size, from
its ``(batch, step s)`` reports, and answers the question TPOT-based admission
asks: the largest batch whose step still fits a target. The SLO planner fits the same line
(``fit_line``) to size the decode pool.

Bookkeeping only: no torch, no Ray.
"""

from __future__ import annotations

import math
import time

Point = tuple[float, float]  # (mean sequences per decode step, mean step seconds)


def fit_line(points: list[Point]) -> tuple[float, float]:
    """``t = a + b * x`` by least squares, with ``a, b >= 0``. One distinct ``x``: the
    step is taken as 70 % fixed cost and 30 % per sequence (conservative: a larger
    batch is assumed to cost more)."""
    xs = [x for x, _ in points]
    mx = sum(xs) / len(points)
    my = sum(t for _, t in points) / len(points)
    var = sum((x - mx) ** 2 for x in xs)
    if var < 1e-9 or len(set(xs)) < 2:
        return 0.7 * my, 0.3 * my / max(mx, 1.0)
    slope = sum((x - mx) * (t - my) for x, t in points) / var
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


class StepTimes:
    """One decode worker's step time by batch size, from its reports.

    Each report (a mean batch and a mean step time over its recent steps) goes to the
    bin of its batch, rounded, as a moving average, so every batch size seen keeps a
    voice: a worker held at one batch for long cannot fill a window with that one
    size and lose the slope. When a report arrives, bins not reported for
    ``max_age_s`` are dropped, so sizes measured under other conditions (a busier
    machine, an earlier load) do not hold the answer once the worker no longer runs
    them.

    ``add`` runs once per poll, ``largest_batch`` once per request and worker: the
    answer is computed once per target and report, not per request."""

    def __init__(self, weight: float = 0.5, max_age_s: float = 30.0, clock=time.monotonic):
        self.weight = weight
        self.max_age_s = max_age_s
        self.clock = clock
        self._bins: dict[int, tuple[float, float]] = {}  # batch (rounded) -> (step s, reported at)
        self._answers: dict[float, int | None] = {}  # target s -> largest batch, since the last add

    def add(self, batch: float, step_s: float) -> None:
        if batch <= 0 or step_s <= 0:
            return  # no decode step measured yet
        now = self.clock()
        for stale in [k for k, (_, at) in self._bins.items() if now - at > self.max_age_s]:
            del self._bins[stale]
        k = max(1, round(batch))
        old = self._bins.get(k)
        step = step_s if old is None else old[0] + self.weight * (step_s - old[0])
        self._bins[k] = (step, now)
        self._answers.clear()

    def __len__(self) -> int:
        return len(self._bins)

    def largest_batch(self, target_s: float) -> int | None:
        """The largest batch whose step time is at most ``target_s``; None (no cap)
        before any report. At least 1: a worker always takes one request.

        From the line fitted over the bins, but never below the largest batch measured
        within the target (so one noisy bin cannot hold the cap below sizes that met
        it, and the sizes near the cap keep being measured). With one size measured
        the slope is unknown: one more than it while its step meets the target (the
        batch grows a step at a time, measuring as it goes), one less once over."""
        if target_s not in self._answers:
            self._answers[target_s] = self._largest_batch(
                {k: t for k, (t, _) in self._bins.items()}, target_s
            )
        return self._answers[target_s]

    @staticmethod
    def _largest_batch(bins: dict[int, float], target_s: float) -> int | None:
        if not bins:
            return None
        within = [k for k, t in bins.items() if t <= target_s]
        if len(bins) == 1:
            ((k, t),) = bins.items()
            return k + 1 if t <= target_s else max(1, k - 1)
        a, b = fit_line(list(bins.items()))
        if b <= 0:
            return None if a <= target_s else max([1, *within])
        fitted = math.floor((target_s - a) / b + 1e-9)
        return max([1, fitted, *within])
