"""``splitserve plan simulate``: one bursty trace through the cluster simulator under
each policy asked for, with a row per policy: TTFT and TPOT percentiles, the share
of requests that met both SLO targets, replica-seconds per pool, and the most
direction reversals of a pool within a minute."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from splitserve.cluster import profiling
from splitserve.cluster.config import CONFIG_DIR, AutoscalingSpec, ClusterConfig
from splitserve.cluster.planner import PlannerSpec, percentile
from splitserve.cluster.profiling import ProfilePlan
from splitserve.cluster.sim_trace import bursty_trace
from splitserve.cluster.simulator import PoolLimits, SimProfile, SimResult, Simulation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy",
        nargs="+",
        default=["fixed", "proportional", "slo"],
        choices=["fixed", "proportional", "slo"],
    )
    p.add_argument("--ttft-ms", type=float, default=500.0, help="TTFT target (default 500)")
    p.add_argument("--tpot-ms", type=float, default=50.0, help="TPOT target (default 50)")
    p.add_argument("--prefill-pool", type=int, nargs=3, default=[1, 1, 8], metavar=("MIN", "START", "MAX"))
    p.add_argument("--decode-pool", type=int, nargs=3, default=[1, 1, 8], metavar=("MIN", "START", "MAX"))
    p.add_argument("--max-total", type=int, default=None, help="prefill + decode workers at most (slo)")
    p.add_argument("--prefill-target", type=float, default=2000, help="proportional: queued prompt tokens")
    p.add_argument("--decode-target", type=float, default=0.7, help="proportional: busy fraction")
    g = p.add_argument_group(
        "profile (one worker of each phase; default: --profile FILE, else an illustrative GPU-like one)"
    )
    g.add_argument("--profile", metavar="FILE", help="a profile `splitserve plan profile` wrote")
    g.add_argument("--prefill-tokens-per-s", type=float)
    g.add_argument("--prefill-step-ms", type=float)
    g.add_argument("--max-batched-tokens", type=int)
    g.add_argument("--decode-step-ms", type=float, nargs=2, metavar=("A", "B"), help="a + b * batch")
    g.add_argument("--max-batch", type=int)
    g.add_argument("--transfer-ms", type=float)
    g.add_argument("--start-s", type=float, help="a new worker's start")
    t = p.add_argument_group("trace")
    t.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    t.add_argument("--rate", type=float, default=4.0, help="requests/s between bursts")
    t.add_argument("--burst-rate", type=float, default=16.0, help="requests/s in a burst")
    t.add_argument("--period", type=float, default=120.0, help="a burst starts every PERIOD s")
    t.add_argument("--burst", type=float, default=40.0, help="and lasts BURST s")
    t.add_argument("--prompt", type=int, nargs=2, default=[500, 2000], metavar=("LO", "HI"))
    t.add_argument("--output", type=int, nargs=2, default=[50, 300], metavar=("LO", "HI"))
    t.add_argument("--seed", type=int, default=0)


ILLUSTRATIVE_PROFILE = SimProfile(
    prefill_tokens_per_s=20_000,
    prefill_step_s=0.010,
    max_batched_tokens=8192,
    decode_step_s=(0.020, 0.0005),
    max_batch=64,
    transfer_s=0.002,
    start_s=30.0,
)


def load_profile(args: argparse.Namespace) -> SimProfile:
    """``--profile FILE`` (or the illustrative one), with any field given on the command line replaced."""
    base = ILLUSTRATIVE_PROFILE
    if args.profile:
        base = SimProfile.from_json(Path(args.profile).read_text())
    given = {
        "prefill_tokens_per_s": args.prefill_tokens_per_s,
        "prefill_step_s": None if args.prefill_step_ms is None else args.prefill_step_ms / 1000,
        "max_batched_tokens": args.max_batched_tokens,
        "decode_step_s": None
        if args.decode_step_ms is None
        else tuple(x / 1000 for x in args.decode_step_ms),
        "max_batch": args.max_batch,
        "transfer_s": None if args.transfer_ms is None else args.transfer_ms / 1000,
        "start_s": args.start_s,
    }
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def run(args: argparse.Namespace) -> dict[str, SimResult]:
    profile = load_profile(args)
    trace = bursty_trace(
        args.duration,
        args.rate,
        args.burst_rate,
        args.period,
        args.burst,
        tuple(args.prompt),
        tuple(args.output),
        args.seed,
    )
    (pmin, pstart, pmax), (dmin, dstart, dmax) = args.prefill_pool, args.decode_pool
    pools = PoolLimits(pstart, pmin, pmax), PoolLimits(dstart, dmin, dmax)
    planner = PlannerSpec(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, max_total_replicas=args.max_total)
    proportional = {
        "prefill": AutoscalingSpec(min_replicas=pmin, max_replicas=pmax, target=args.prefill_target),
        "decode": AutoscalingSpec(min_replicas=dmin, max_replicas=dmax, target=args.decode_target),
    }
    return {
        policy: Simulation(profile, trace, *pools, policy, planner=planner, proportional=proportional).run()
        for policy in args.policy
    }


def _ms(values: list[float], q: float) -> float:
    p = percentile(values, q)
    return math.nan if p is None else p * 1e3


def main(args: argparse.Namespace) -> int:
    results = run(args)
    n = len(next(iter(results.values())).requests) if results else 0
    slo = f"TTFT {args.ttft_ms:.0f} ms, TPOT {args.tpot_ms:.0f} ms"
    print(f"{n} requests over {args.duration:.0f} s; SLO: {slo}")
    print(
        f"{'policy':<13}{'TTFT p50/p90 ms':>18}{'TPOT p50/p90 ms':>18}{'met SLO':>9}"
        f"{'prefill rs':>12}{'decode rs':>11}{'reversals/min':>15}"
    )
    for policy, r in results.items():
        ttft, tpot = r.ttft_s(), r.tpot_s()
        print(
            f"{policy:<13}"
            f"{_ms(ttft, 50):>9.0f}/{_ms(ttft, 90):<8.0f}"
            f"{_ms(tpot, 50):>9.1f}/{_ms(tpot, 90):<8.1f}"
            f"{r.attainment(args.ttft_ms, args.tpot_ms):>9.3f}"
            f"{r.replica_seconds['prefill']:>12.0f}{r.replica_seconds['decode']:>11.0f}"
            f"{r.reversals_per_minute('prefill'):>8d} / {r.reversals_per_minute('decode'):<4d}"
        )
    return 0


# ---- splitserve plan profile -------------------------------------------------------------
def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--server",
        help="profile the cluster at HOST:PORT (its batch limits are taken to be the embedded config's)",
    )
    where.add_argument(
        "--config",
        help="start a cluster from this config, profile it, stop it (default: the embedded one)",
    )
    p.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=list(ProfilePlan.prompt_lens))
    p.add_argument(
        "--repeats", type=int, default=ProfilePlan.prefill_repeats, help="requests per prompt length"
    )
    p.add_argument("--batches", type=int, nargs="+", default=list(ProfilePlan.batches))
    p.add_argument("--output-len", type=int, default=ProfilePlan.decode_output_len)
    p.add_argument(
        "--start-s", type=float, default=ProfilePlan.start_s, help="a new worker's start (not measured)"
    )


def main_profile(args: argparse.Namespace) -> int:
    from splitserve.loadgen.compare import Server

    config = ClusterConfig.load(args.config)
    plan = profiling.plan_for(
        config,
        prompt_lens=tuple(args.prompt_lens),
        prefill_repeats=args.repeats,
        batches=tuple(args.batches),
        decode_output_len=args.output_len,
        start_s=args.start_s,
    )
    server = None
    if args.server is None:
        print(f"starting a cluster from {args.config or 'the embedded config'} ...")
        server = Server(
            args.config or str(CONFIG_DIR / "local.yaml"), Path(args.out).with_suffix(".serve.log")
        )
    try:
        profile, m = profiling.profile(args.server or server.address, plan)
    finally:
        if server is not None:
            server.stop()
    Path(args.out).write_text(profile.to_json() + "\n")
    print("prefill  (tokens, TTFT ms): " + ", ".join(f"({n}, {t * 1e3:.1f})" for n, t in m.prefill))
    print("decode   (batch, step ms):  " + ", ".join(f"({b}, {t * 1e3:.2f})" for b, t in m.decode))
    (a, b), pf = profile.decode_step_s, profile
    print(
        f"profile: prefill {pf.prefill_tokens_per_s:.0f} tokens/s + {pf.prefill_step_s * 1e3:.1f} ms a step; "
        f"decode step {a * 1e3:.2f} + {b * 1e3:.3f} * B ms; handover {pf.transfer_s * 1e3:.1f} ms; "
        f"slowdown sharing cores: prefill {pf.prefill_slowdown:.2f}, decode {pf.decode_slowdown:.2f} "
        f"-> {args.out}"
    )
    return 0
