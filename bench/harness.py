"""What the studies in ``bench/`` share: a Ray instance of their own with a config
served on it, a baseline and a candidate measured in the same run, the ratio
printed, the figures written as JSON.

These machines differ (Intel with AMX, AMD with AVX-512 bf16) and drift by 20 %
or more within the hour, so a study's figure is a ratio against a baseline
measured in the same run, never an absolute number compared across runs::

    with harness.served(config) as cluster:          # Ray of its own; both gone after
        pair = harness.paired(run_baseline, run_candidate, rounds=5)   # alternated, warmed
    harness.report("served / offline", pair, json_path=args.json, model=args.model)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ray

from splitserve.cluster.app import BackgroundCluster, start_local_ray
from splitserve.cluster.config import ClusterConfig


@contextlib.contextmanager
def local_ray(num_cpus: int | None = 2, **kwargs) -> Iterator[None]:
    """A new local Ray instance of this process's own (never one the machine already
    runs), shut down on the way out. ``num_cpus`` None: every core."""
    kwargs.setdefault("log_to_driver", False)
    start_local_ray(num_cpus, **kwargs)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def served(config: ClusterConfig, num_cpus: int | None = 2, **kwargs) -> Iterator[BackgroundCluster]:
    """``config`` served (router and pools) on a Ray instance of its own (``local_ray``)."""
    with local_ray(num_cpus, **kwargs), BackgroundCluster(config) as cluster:
        yield cluster


@dataclass(frozen=True)
class Paired:
    """A baseline's and a candidate's figures, round by round (each round measured both,
    one right after the other)."""

    baseline: list[float]
    candidate: list[float]

    @property
    def ratio(self) -> float:
        """The median over rounds of candidate / baseline."""
        return statistics.median(c / b for b, c in zip(self.baseline, self.candidate, strict=True))


def paired(
    baseline: Callable[[], float], candidate: Callable[[], float], rounds: int, warmup: int = 1
) -> Paired:
    """Measure both ``rounds`` times, alternating, after ``warmup`` unrecorded runs of
    each: the machine's drift weighs on both alike."""
    for _ in range(warmup):
        baseline()
        candidate()
    base, cand = [], []
    for _ in range(rounds):
        base.append(baseline())
        cand.append(candidate())
    return Paired(base, cand)


def table(header: list[str], rows: list[list]) -> str:
    """A plain table, each column as wide as its widest cell: the first (the rows' names)
    left-aligned, the figures right-aligned (floats to two decimals)."""
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    )


def report(what: str, ratio: float, json_path: str | None = None, **figures) -> None:
    """Print ``what = ratio`` (the study's answer), and write it with ``figures`` to
    ``json_path`` when given."""
    print(f"{what} = {ratio:.3f}x")
    if json_path:
        Path(json_path).write_text(json.dumps({"what": what, "ratio": ratio, **figures}, indent=2) + "\n")
        print(f"figures written to {json_path}", file=sys.stderr)


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures here as JSON")
