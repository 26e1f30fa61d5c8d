"""Traces for the cluster simulator: requests (arrival time, prompt and output
lengths) with Poisson arrivals at a rate that varies over time, by thinning."""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def _poisson_trace(
    rate_at: Callable[[float], float],
    peak: float,
    duration_s: float,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int,
) -> list[SimRequest]:
    """Poisson arrivals at ``rate_at(t)`` (never above ``peak``), by thinning; lengths
    uniform in the given ranges."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while peak > 0:
        t += rng.expovariate(peak)
        if t >= duration_s:
            break
        if rng.random() * peak < rate_at(t):
            out.append(SimRequest(t, rng.randint(*prompt_tokens), rng.randint(*output_tokens)))
    return out


def bursty_trace(
    duration_s: float,
    base_rate: float,
    burst_rate: float,
    period_s: float,
    burst_s: float,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int = 0,
) -> list[SimRequest]:
    """Poisson arrivals at ``burst_rate`` during the first ``burst_s`` of every
    ``period_s`` and ``base_rate`` otherwise; lengths uniform in the given ranges."""

    def rate_at(t: float) -> float:
        return burst_rate if (t % period_s) < burst_s else base_rate

    return _poisson_trace(rate_at, max(base_rate, burst_rate), duration_s, prompt_tokens, output_tokens, seed)


def schedule_trace(
    schedule: list[tuple[float, float]],
    duration_s: float,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int = 0,
) -> list[SimRequest]:
    """Poisson arrivals at a piecewise-constant rate: ``schedule`` lists ``(from_s,
    rate)`` in time order (the first from 0), each rate holding until the next;
    e.g. ``[(0, 20), (120, 100), (300, 20)]`` is a 5x load step from 120 s to 300 s."""
    if not schedule or schedule[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(schedule, schedule[1:])):
        raise ValueError("schedule must start at 0 and be in increasing time order")
    starts = [t for t, _ in schedule]

    def rate_at(t: float) -> float:
        return schedule[bisect.bisect_right(starts, t) - 1][1]

    return _poisson_trace(
        rate_at, max(r for _, r in schedule), duration_s, prompt_tokens, output_tokens, seed
    )
