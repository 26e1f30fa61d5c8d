"""Does the cluster simulator predict the real cluster? The same trace (arrival
times, prompt and output lengths) is sent to a real cluster through the SDK and
run through ``cluster.simulator`` with the cluster's measured profile
(``cluster.profiling``); the p50 and p90 TTFT and TPOT of each are printed
side by side, at each request rate, with their ratio::

    python -m splitserve.bench.sim_check --config cluster_configs/sim_check.yaml \\
        --rates 1 2 --num-prompts 150 --result-json sim_check.json

The cluster is started from ``--config`` (or reached at ``--server``, whose pool
sizes ``--pools`` gives) and profiled first, unless ``--profile FILE`` gives a
profile measured before. Prompts are fresh random ids (no prefix-cache hits)
that fit one prefill step, as the simulator assumes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from splitserve.client import Client
from splitserve.cluster import profiling
from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.planner import percentile
from splitserve.cluster.sim_trace import SimRequest
from splitserve.cluster.simulator import PoolLimits, SimProfile, Simulation
from splitserve.loadgen import workloads
from splitserve.loadgen.compare import Server
from splitserve.loadgen.serve import run_load

GOAL = 0.25  # the bound on |simulated / measured - 1|


@dataclass(frozen=True)
class Comparison:
    rate: float
    metric: str  # e.g. "p90 TTFT"
    measured_ms: float
    simulated_ms: float

    @property
    def ratio(self) -> float:
        return self.simulated_ms / self.measured_ms


def _pct_ms(values: list[float], q: float) -> float:
    p = percentile(values, q)
    return float("nan") if p is None else p * 1e3


def compare_rate(
    address: str,
    profile: SimProfile,
    pools: tuple[int, int],
    rate: float,
    reqs: list[workloads.BenchRequest],
    seed: int,
) -> list[Comparison]:
    """Run ``reqs`` at ``rate`` (Poisson) on the cluster and in the simulator."""
    arrivals = workloads.arrival_times(len(reqs), rate, seed=seed)
    records, _ = asyncio.run(run_load(address, reqs, arrivals, progress=False))
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed on the cluster, e.g.: {failed[0]}")
    trace = [SimRequest(a, len(r.prompt_ids), r.output_len) for a, r in zip(arrivals, reqs)]
    (p, d) = pools
    sim = Simulation(profile, trace, PoolLimits(p, p, p), PoolLimits(d, d, d), "fixed").run()
    measured = {"TTFT": [r.ttft for r in records], "TPOT": [t for r in records if (t := r.tpot) is not None]}
    simulated = {"TTFT": sim.ttft_s(), "TPOT": sim.tpot_s()}
    return [
        Comparison(rate, f"p{q} {m}", _pct_ms(measured[m], q), _pct_ms(simulated[m], q))
        for m in ("TTFT", "TPOT")
        for q in (50, 90)
    ]


def print_table(rows: list[Comparison]) -> None:
    print(f"{'rate':>6} {'metric':<9}{'measured ms':>13}{'simulated ms':>14}{'sim/real':>10}")
    for c in rows:
        flag = "" if abs(c.ratio - 1) <= GOAL else "  (outside 25 %)"
        print(
            f"{c.rate:>6.2f} {c.metric:<9}{c.measured_ms:>13.1f}{c.simulated_ms:>14.1f}{c.ratio:>10.2f}{flag}"
        )
    worst = max(abs(c.ratio - 1) for c in rows)
    print(f"largest |sim/real - 1|: {worst:.2f} (goal <= {GOAL})")


def check(
    address: str,
    profile: SimProfile,
    pools: tuple[int, int],
    rates: list[float],
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int = 0,
) -> list[Comparison]:
    with Client(address, timeout=60) as c:
        (model,) = c.list_models()
    rows = []
    for i, rate in enumerate(rates):
        reqs = workloads.random_requests(
            num_prompts, input_len, output_len, model.vocab_size, seed=seed + 1 + i, range_ratio=range_ratio
        )
        rows += compare_rate(address, profile, pools, rate, reqs, seed + 1 + i)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", help="a running cluster at HOST:PORT (give its --pools)")
    where.add_argument("--config", default="cluster_configs/sim_check.yaml", help="start this cluster")
    p.add_argument("--pools", type=int, nargs=2, metavar=("P", "D"), help="prefill and decode workers")
    p.add_argument("--profile", help="a profile measured before (default: measure it first)")
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--num-prompts", type=int, default=150, help="requests per rate")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=40)
    p.add_argument("--range-ratio", type=float, default=0.75, help="lengths uniform in len * (1 -/+ r)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json")


def main(args: argparse.Namespace) -> int:
    config = ClusterConfig.load(args.config if args.server is None else None)
    pools = tuple(args.pools) if args.pools else (config.prefill.replicas, config.decode.replicas)
    server = None
    if args.server is None:
        server = Server(args.config, Path(args.result_json or "sim_check").with_suffix(".serve.log"))
    address = args.server or server.address
    try:
        if args.profile:
            profile = SimProfile.from_json(Path(args.profile).read_text())
        else:
            profile, _ = profiling.profile(address, profiling.plan_for(config))
        print(f"profile: {profile}")
        rows = check(
            address,
            profile,
            pools,
            args.rates,
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.seed,
        )
    finally:
        if server is not None:
            server.stop()
    print_table(rows)
    if args.result_json:
        payload = {"profile": asdict(profile), "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]}
        Path(args.result_json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
