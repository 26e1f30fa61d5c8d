"""Does the cluster simulator predict an elastic cluster's split? Replays the trace a
``splitserve bench compare`` run recorded (each request's send time, prompt and output
length: ``over_time.sent`` in its ``compare.json``) through ``cluster.simulator`` with
policy ``elastic`` (the same ``Planner`` the cluster ran, the config's planner section
and role bounds) and a measured ``SimProfile``, and sets beside the measured run:

    split     time-weighted mean prefill workers over the run (measured: the roles
              the load generator sampled every 0.5 s; simulated: the planner's
              timeline), and the same as a share of the workers
    goodput   requests that met the SLO per second of the run

with |simulated / measured - 1| against the issue's 25 %::

    splitserve bench compare --dataset shifting ... \\
        --disaggregated cluster_configs/bench_disaggregated.yaml cluster_configs/bench_elastic.yaml \\
        --out-dir shift
    splitserve plan profile --config cluster_configs/sim_check.yaml --out profile.json
    python -m splitserve.bench.elastic_sim --compare shift/compare.json --profile profile.json \\
        --config cluster_configs/bench_elastic.yaml
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.sim_trace import SimRequest
from splitserve.cluster.simulator import PoolLimits, SimProfile, SimResult, Simulation

GOAL = 0.25  # the bound on |simulated / measured - 1|


@dataclass(frozen=True)
class Prediction:
    rate: float
    measured_prefill: float  # time-weighted mean prefill workers
    simulated_prefill: float
    measured_goodput: float  # req/s meeting the SLO
    simulated_goodput: float


def mean_prefill(changes: list[list[float]], end_s: float) -> float:
    """Time-weighted mean of the prefill workers over [0, end_s], from ``[t, prefill,
    decode]`` changes (the first holds from time 0)."""
    if not changes or end_s <= 0:
        return 0.0
    total, points = 0.0, [[0.0, *changes[0][1:]], *changes[1:]]
    for (t, p, _), (u, _, _) in zip(points, [*points[1:], [end_s, 0, 0]], strict=True):
        total += p * max(min(u, end_s) - max(t, 0.0), 0.0)
    return total / end_s


def simulate(config: ClusterConfig, profile: SimProfile, sent: list[list[float]]) -> SimResult:
    """The recorded trace through the elastic simulator, with the config's roles."""
    trace = [SimRequest(t, int(prompt), max(int(output), 1)) for t, prompt, output in sent]
    limits = []
    for pool in (config.prefill, config.decode):
        scaling = pool.autoscaling
        limits.append(PoolLimits(pool.replicas, scaling.min_replicas, scaling.max_replicas))
    return Simulation(profile, trace, *limits, "elastic", planner=config.planner).run()


def predict(run: dict, config: ClusterConfig, profile: SimProfile, slo: dict[str, float]) -> Prediction:
    over = run["over_time"]
    sim = simulate(config, profile, over["sent"])
    timeline = [[t, p, d] for t, p, d in sim.timeline]
    if not timeline or timeline[0][0] > 0:
        timeline.insert(0, [0.0, config.prefill.replicas, config.decode.replicas])
    met = sum(r.met(slo.get("ttft", float("inf")), slo.get("tpot", float("inf"))) for r in sim.requests)
    return Prediction(
        run["request_rate"],
        mean_prefill(over["roles"], run["duration"]),
        mean_prefill(timeline, sim.end_s),
        run["request_goodput"],
        met / sim.end_s,
    )


def report(preds: list[Prediction], workers: int) -> list[str]:
    lines = [
        "| rate | prefill workers, measured | simulated | ratio | goodput req/s, measured | simulated "
        "| ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in preds:
        split = p.simulated_prefill / p.measured_prefill if p.measured_prefill else float("nan")
        good = p.simulated_goodput / p.measured_goodput if p.measured_goodput else float("nan")
        lines.append(
            f"| {p.rate:g} | {p.measured_prefill:.2f} of {workers} | {p.simulated_prefill:.2f} | {split:.2f} "
            f"| {p.measured_goodput:.2f} | {p.simulated_goodput:.2f} | {good:.2f} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", required=True, help="compare.json of a `splitserve bench compare` run")
    ap.add_argument("--profile", required=True, help="a profile `splitserve plan profile` wrote")
    ap.add_argument(
        "--config", default="cluster_configs/bench_elastic.yaml", help="the elastic setup's config"
    )
    ap.add_argument(
        "--label", default=None, help="the elastic setup's label in the JSON (default: by config)"
    )
    ap.add_argument(
        "--switch-s", type=float, default=None, help="a role switch's seconds (profile's if unset)"
    )
    args = ap.parse_args()
    data = json.loads(Path(args.compare).read_text())
    config = ClusterConfig.load(args.config)
    label = args.label or next(k for k in data if k not in ("args", "ratios") and Path(args.config).stem in k)
    profile = SimProfile.from_json(Path(args.profile).read_text())
    if args.switch_s is not None:
        profile = SimProfile(**{**profile.__dict__, "switch_s": args.switch_s})
    slo = {k: float(v) for k, v in (item.split(":") for item in data["args"]["goodput"])}
    preds = [predict(run, config, profile, slo) for run in data[label]]
    print("\n".join(report(preds, config.elastic_workers)))
    print(f"\nlargest |simulated / measured - 1|: {max(map(error, preds)):.2f} (goal <= {GOAL})")


def error(p: Prediction) -> float:
    """The larger of the split's and the goodput's |simulated / measured - 1| (a split
    measured at no prefill worker: the simulated prefill workers themselves)."""
    split = p.simulated_prefill
    if p.measured_prefill > 0:
        split = abs(p.simulated_prefill / p.measured_prefill - 1)
    good = abs(p.simulated_goodput / p.measured_goodput - 1) if p.measured_goodput else float("inf")
    return max(split, good)


if __name__ == "__main__":
    main()
