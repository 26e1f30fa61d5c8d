"""The SLO planner against the proportional policy and fixed prefill:decode
splits, in the cluster simulator, on a trace with a 5x load step and bursts::

    python -m splitserve.bench.planner_study --profile docs/bench/profile_cpu.json \\
        --base-rate 20 --max-per-pool 64 --plot docs/bench/planner_study.png

The trace (rates as multiples of ``--base-rate``, Poisson arrivals)::

    0-120 s  1x    120-300 s  5x (the step)    300-600 s  1x, with 3x bursts
                                               of 10 s at 360 s and 480 s

What it reports, each policy on the same trace:

- ``slo``: the planner (``cluster.planner``), both pools from 1 worker each
  (with ``--headroom H1 H2 ...``: compared at H1, a row more for each other H);
- ``proportional``: each pool alone on its load (``cluster.autoscale``), at
  each of a few targets (queued prompt tokens per prefill worker, busy
  fraction per decode worker): more aggressive targets buy attainment with
  replica-seconds;
- ``fixed, same replica-seconds``: every P:D split of the worker count the
  planner used on average, the best of them;
- ``fixed, cheapest at the planner's attainment``: the fewest workers, best
  split, that meet at least the planner's SLO attainment.

Attainment is the share of all requests that met both the TTFT and the TPOT
target; reversals are the most changes of direction of a pool within a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from splitserve.cluster.config import AutoscalingSpec
from splitserve.cluster.planner import PlannerSpec
from splitserve.cluster.sim_trace import SimRequest, schedule_trace
from splitserve.cluster.simulator import PoolLimits, SimProfile, SimResult, Simulation

SCHEDULE = ((0, 1), (120, 5), (300, 1), (360, 3), (370, 1), (480, 3), (490, 1))
DURATION_S = 600.0
PROPORTIONAL_TARGETS = ((250, 0.5), (500, 0.7), (2000, 0.7), (1000, 0.9))  # (queued tokens, busy)


@dataclass(frozen=True)
class Row:
    label: str
    result: SimResult
    attainment: float
    split: tuple[int, int] | None = None  # fixed splits: (P, D)

    @property
    def replica_seconds(self) -> float:
        return sum(self.result.replica_seconds.values())


@dataclass(frozen=True)
class Study:
    """One trace, a profile, the SLO and the pools' ceiling; ``run`` compares the policies."""

    profile: SimProfile
    trace: list[SimRequest]
    ttft_ms: float
    tpot_ms: float
    max_per_pool: int
    headroom: float = 0.0  # the planner's (PlannerSpec.headroom)

    def _row(self, label: str, result: SimResult, split=None) -> Row:
        return Row(label, result, result.attainment(self.ttft_ms, self.tpot_ms), split)

    def slo(self, headroom: float | None = None) -> Row:
        """The planner's row, with the study's headroom unless another is given."""
        headroom = self.headroom if headroom is None else headroom
        spec = PlannerSpec(ttft_ms=self.ttft_ms, tpot_ms=self.tpot_ms, headroom=headroom)
        pool = PoolLimits(1, 1, self.max_per_pool)
        sim = Simulation(self.profile, self.trace, pool, pool, "slo", planner=spec)
        return self._row(f"headroom {headroom:g}", sim.run())

    def proportional(self) -> list[Row]:
        rows = []
        for tokens, busy in PROPORTIONAL_TARGETS:
            specs = {
                "prefill": AutoscalingSpec(min_replicas=1, max_replicas=self.max_per_pool, target=tokens),
                "decode": AutoscalingSpec(min_replicas=1, max_replicas=self.max_per_pool, target=busy),
            }
            pool = PoolLimits(1, 1, self.max_per_pool)
            sim = Simulation(self.profile, self.trace, pool, pool, "proportional", proportional=specs)
            rows.append(self._row(f"{tokens} queued tokens, {busy} busy", sim.run()))
        return rows

    def fixed(self, p: int, d: int) -> Row:
        sim = Simulation(self.profile, self.trace, PoolLimits(p, p, p), PoolLimits(d, d, d), "fixed")
        return self._row(f"fixed {p}P:{d}D", sim.run(), (p, d))

    def best_split(self, total: int) -> Row:
        """The split of ``total`` workers with the highest attainment: a coarse scan
        of the prefill share, then every split around the best coarse one."""
        step = max(1, total // 10)
        coarse = {p: self.fixed(p, total - p) for p in range(step, total, step)}
        best = max(coarse, key=lambda p: coarse[p].attainment)
        fine = {p: self.fixed(p, total - p) for p in range(max(1, best - step + 1), min(total, best + step))}
        return max({**coarse, **fine}.values(), key=lambda r: r.attainment)

    def cheapest_split(self, attainment: float, low: int) -> Row | None:
        """The fewest workers (and their best split) reaching ``attainment``; None
        within twice ``max_per_pool``. Assumes more workers never do worse."""
        hi = 2 * self.max_per_pool
        best = self.best_split(hi)
        if best.attainment < attainment:
            return None
        while low < hi:  # invariant: hi reaches it
            mid = (low + hi) // 2
            row = self.best_split(mid)
            if row.attainment >= attainment:
                hi, best = mid, row
            else:
                low = mid + 1
        return best

    def run(self) -> dict[str, Row]:
        slo = self.slo()
        mean_workers = round(slo.replica_seconds / slo.result.end_s)
        same = self.best_split(max(mean_workers, 2))
        return {
            "slo": slo,
            **{f"proportional {i + 1}": row for i, row in enumerate(self.proportional())},
            "fixed, same replica-seconds": same,
            "fixed, cheapest at slo's attainment": self.cheapest_split(slo.attainment, mean_workers),
        }


def trace_for(
    base_rate: float, prompt: tuple[int, int], output: tuple[int, int], seed: int
) -> list[SimRequest]:
    schedule = [(t, base_rate * m) for t, m in SCHEDULE]
    return schedule_trace(schedule, DURATION_S, prompt, output, seed)


def print_table(rows: dict[str, Row | None]) -> None:
    print(
        "| policy | attainment | replica-seconds (P + D) | peak P / D | reversals/min P / D |\n"
        "|---|---|---|---|---|"
    )
    for name, row in rows.items():
        if row is None:
            print(f"| {name} | not reached | | | |")
            continue
        r = row.result
        peak = (
            row.split
            if row.split
            else (
                max((p for _, p, _ in r.timeline), default=0),
                max((d for _, _, d in r.timeline), default=0),
            )
        )
        rs = r.replica_seconds
        print(
            f"| {name}: {row.label} | {row.attainment:.3f} | {row.replica_seconds:.0f} "
            f"({rs['prefill']:.0f} + {rs['decode']:.0f}) | {peak[0]} / {peak[1]} "
            f"| {r.reversals_per_minute('prefill')} / {r.reversals_per_minute('decode')} |"
        )


def _windows(row: Row, study: Study, width_s: float) -> tuple[list[float], list[float]]:
    buckets: dict[int, list[bool]] = {}
    for o in row.result.requests:
        buckets.setdefault(int(o.spec.arrival_s // width_s), []).append(o.met(study.ttft_ms, study.tpot_ms))
    keys = sorted(buckets)
    return [k * width_s for k in keys], [sum(buckets[k]) / len(buckets[k]) for k in keys]


def plot(rows: dict[str, Row | None], study: Study, path: str) -> None:
    from splitserve.loadgen.plots import _plt

    plt = _plt()
    fig, (ax_load, ax_rep, ax_att) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    arrivals = [r.arrival_s for r in study.trace]
    ax_load.hist(arrivals, bins=int(DURATION_S // 5), weights=[1 / 5] * len(arrivals), color="grey")
    ax_load.set_ylabel("arrivals (req/s)")
    ax_load.set_title(f"SLO: p90 TTFT {study.ttft_ms:.0f} ms, TPOT {study.tpot_ms:.0f} ms")
    prop = max((r for n, r in rows.items() if n.startswith("proportional")), key=lambda r: r.attainment)
    for name, row, style in (("slo", rows["slo"], "-"), ("proportional (best)", prop, ":")):
        tl = row.result.timeline
        t = [x for x, _, _ in tl]
        ax_rep.plot(t, [p for _, p, _ in tl], "C0" + style, label=f"{name}: prefill")
        ax_rep.plot(t, [d for _, _, d in tl], "C1" + style, label=f"{name}: decode")
    ax_rep.set_ylabel("routable workers")
    ax_rep.legend(fontsize=8)
    for name, row in rows.items():
        if row is not None:
            x, y = _windows(row, study, 20.0)
            ax_att.step(x, y, where="post", label=f"{name} ({row.attainment:.2f})")
    ax_att.set_ylabel("SLO attainment (20 s windows)")
    ax_att.set_xlabel("arrival time (s)")
    ax_att.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="a profile `splitserve plan profile` wrote")
    p.add_argument("--base-rate", type=float, default=20.0, help="requests/s outside the step and bursts")
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--max-per-pool", type=int, default=64)
    p.add_argument("--prompt", type=int, nargs=2, default=[64, 448], metavar=("LO", "HI"))
    p.add_argument("--output", type=int, nargs=2, default=[200, 400], metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--headroom",
        type=float,
        nargs="+",
        default=[0.0],
        help="the slo planner's headroom (default 0); the first value is the one compared with the other "
        "policies, further values add a row each",
    )
    p.add_argument("--plot", help="write the replicas/attainment plot here (needs matplotlib)")
    args = p.parse_args(argv)
    # At this scale each worker has its own machine: no slowdown from sharing cores.
    profile = dataclasses.replace(
        SimProfile.from_json(Path(args.profile).read_text()), prefill_slowdown=0.0, decode_slowdown=0.0
    )
    trace = trace_for(args.base_rate, tuple(args.prompt), tuple(args.output), args.seed)
    study = Study(profile, trace, args.ttft_ms, args.tpot_ms, args.max_per_pool, args.headroom[0])
    print(f"{len(trace)} requests over {DURATION_S:.0f} s; profile {profile}")
    rows = study.run()
    rows |= {f"slo {i + 2}": study.slo(h) for i, h in enumerate(args.headroom[1:])}
    print_table(rows)
    if args.plot:
        plot(rows, study, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
