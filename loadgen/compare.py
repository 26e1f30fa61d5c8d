"""``splitserve bench compare``: the same workload against a colocated cluster
and one or more disaggregated ones on equal resources, one after the other, and
the ratios.

    splitserve bench compare --dataset mixed --num-prompts 120 --request-rate 1 2 3 \\
        --goodput tpot:150 --out-dir bench-results/
    splitserve bench compare --splits 1:1 2:1 1:2 ...     # pool ratios, same cores
    splitserve bench compare --disaggregated a.yaml b.yaml ...  # several against colocated
    splitserve bench compare --engine kv_cache_memory_mib=128 ...  # set in every setup's pools
    splitserve bench compare --policy local_prefill_max_stall_ms=2000 ...  # every setup's router policy

Each setup is a real ``splitserve serve`` process (its own Ray instance,
router and workers), started from a config, warmed up, measured at every
rate, then stopped with SIGINT. The defaults are
``cluster_configs/bench_disaggregated.yaml`` (1 prefill + 1 decode worker) and
``cluster_configs/bench_colocated.yaml`` (2 colocated workers): each worker
one core, pinned, one torch thread.

``--splits P:D ...`` replaces the disaggregated setup by one per split: the
disaggregated config with P prefill and D decode workers, on the cores its
pools pin to (``--cores`` to choose), shared out in turn (worker k of the
P + D on core k mod cores) and each reserving cores / (P + D) of Ray's CPUs.
So on 2 cores, 2:1 runs a prefill worker per core and the decode worker
time-shares core 0 with prefill-0: the ratio a workload wants, on the
hardware it has.

Ratios are each disaggregated setup ÷ colocated: below 1 is better for
latencies, above 1 is better for goodput, attainment and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from splitserve.client import Client
from splitserve.loadgen import serve

RATIO_KEYS = (
    "median_handover_ms",
    "p99_itl_ms",
    "p99_tpot_ms",
    "p90_ttft_ms",
    "median_ttft_ms",
    "request_goodput",
    "slo_attainment",
    "request_throughput",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``splitserve serve`` subprocess on a free port, its log in ``log_path``."""

    def __init__(self, config: str, log_path: Path, start_timeout_s: float = 900):
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w")
        cmd = [
            sys.executable,
            "-m",
            "splitserve.cli.main",
            "serve",
            "--config",
            config,
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"splitserve serve --config {config} exited; see {log_path}")
            with Client(self.address, retries=0) as probe:
                if probe.health(timeout=1.0):
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"splitserve serve --config {config} was not ready in time; see {log_path}"
                )
            time.sleep(1.0)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def warm_up(address: str, n: int) -> None:
    with Client(address, timeout=300) as c:
        for i in range(n):
            c.generate(list(range(100, 164 + 64 * i)), temperature=0, max_tokens=8, ignore_eos=True)


def split_config(base: str, prefill: int, decode: int, cores: list[int] | None, out: Path) -> Path:
    """``base`` (a disaggregated config) with ``prefill`` + ``decode`` workers sharing
    ``cores`` (default: the cores its pools pin to) in turn; written under ``out``."""
    data = yaml.safe_load(Path(base).read_text())
    if data.get("mode", "disaggregated") != "disaggregated":
        raise ValueError(f"--splits needs a disaggregated config, not {base}")
    if cores is None:
        pinned = [c for role in ("prefill", "decode") for c in data.get(role, {}).get("cpu_ids") or []]
        cores = sorted(set(pinned))
    if not cores:
        raise ValueError(f"{base} pins its workers to no cores: give --cores")
    share = math.floor(1000 * len(cores) / (prefill + decode)) / 1000  # the shares fit in Ray's CPUs
    for role, count, first in (("prefill", prefill, 0), ("decode", decode, prefill)):
        pool = data.setdefault(role, {})
        pool["replicas"] = count
        pool["num_cpus"] = share
        pool["torch_threads"] = 1
        pool["cpu_ids"] = [cores[(first + k) % len(cores)] for k in range(count)]
        pool.pop("autoscaling", None)  # the split is the point: no pool resizes during the run
    path = out / f"split_{prefill}p{decode}d.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def parse_split(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a split is PREFILL:DECODE, e.g. 2:1, not {text!r}") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"a split needs at least one worker of each phase, not {text!r}")
    return p, d


def ratios(disagg: list, coloc: list) -> list[dict]:
    out = []
    for d, c in zip(disagg, coloc):
        row = {"request_rate": d.rate}
        for key in RATIO_KEYS:
            if key in d.metrics and key in c.metrics:
                denom = c.metrics[key]
                row[key] = d.metrics[key] / denom if denom else float("inf")
        out.append(row)
    return out


def print_ratios(label: str, rows: list[dict], disagg: list, coloc: list) -> None:
    print(
        f"\n==== {label} ÷ colocated "
        "(latencies: < 1 is better; goodput, attainment, throughput: > 1 is better) ===="
    )
    keys = [k for k in RATIO_KEYS if k in rows[0]]
    print(f"{'rate':>6} " + " ".join(f"{k:>16}" for k in keys))
    for row in rows:
        print(f"{row['request_rate']:>6g} " + " ".join(f"{row[k]:>16.3f}" for k in keys))
    print(f"\nabsolute values ({label} / colocated):")
    for d, c in zip(disagg, coloc):
        cells = [f"{k}={d.metrics[k]:.1f}/{c.metrics[k]:.1f}" for k in keys if k in d.metrics]
        print(f"  rate {d.rate:g}: " + ", ".join(cells))


def setups(args: argparse.Namespace, out: Path) -> dict[str, str]:
    """Label -> config of every setup, the colocated baseline first (each with the
    ``--engine`` options set in all its pools and the ``--policy`` ones in its policy)."""
    found = {"colocated": args.colocated}
    configs = args.disaggregated
    if not args.splits:
        if len(configs) == 1:
            found |= {"disaggregated": configs[0]}
        else:
            found |= {Path(c).stem: c for c in configs}
    elif len(configs) > 1:
        raise ValueError("--splits builds its setups from one --disaggregated config")
    else:
        for p, d in args.splits:
            found[f"{p}P:{d}D"] = str(split_config(configs[0], p, d, args.cores, out))
    engine = {k: v for item in args.engine for k, v in item.items()}
    policy = {k: v for item in args.policy for k, v in item.items()}
    if engine or policy:
        found = {
            label: str(engine_config(config, engine, out, label, policy)) for label, config in found.items()
        }
    return found


def engine_config(
    base: str, options: dict[str, object], out: Path, label: str, policy: dict[str, object] | None = None
) -> Path:
    """``base`` with ``options`` set in the ``engine`` section of every pool it runs, and
    ``policy`` in its ``policy`` section."""
    data = yaml.safe_load(Path(base).read_text())
    roles = ("colocated",) if data.get("mode") == "colocated" else ("prefill", "decode")
    for role in roles:
        data.setdefault(role, {}).setdefault("engine", {}).update(options)
    data.setdefault("policy", {}).update(policy or {})
    path = out / f"{label.replace(':', '')}_engine.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def parse_engine_options(items: list[str]) -> dict[str, object]:
    """``["host_kv_tier_mib=1024"]`` -> ``{"host_kv_tier_mib": 1024}`` (values read as YAML;
    the same for ``--policy``)."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine and --policy take KEY=VALUE, got {item!r}")
        options[key] = yaml.safe_load(value)
    return options


def main(args: argparse.Namespace) -> int:
    from splitserve.loadgen import plots

    out = Path(args.out_dir)
    runs = {}
    for label, config in setups(args, out).items():
        print(f"---- {label}: starting splitserve serve --config {config}", file=sys.stderr)
        server = Server(config, out / f"{label.replace(':', '')}.log")
        try:
            warm_up(server.address, args.warmup)
            runs[label] = asyncio.run(serve.run_rates(args, server.address))
        finally:
            server.stop()
        for r in runs[label]:
            serve.print_summary(label, r.metrics)
    coloc = runs["colocated"]
    table = {}
    for label, results in runs.items():
        if label != "colocated":
            table[label] = ratios(results, coloc)
            print_ratios(label, table[label], results, coloc)
    serve.write_json(
        str(out / "compare.json"),
        {"args": {k: v for k, v in vars(args).items() if k != "func"}, "ratios": table}
        | {label: [r.metrics for r in results] for label, results in runs.items()},
    )
    if plots.available():
        plots.write_all(str(out), runs, serve.parse_goodput(args.goodput))
        print(f"\nwrote {out / 'compare.json'} and plots in {out}/", file=sys.stderr)
    else:
        print(f"\nwrote {out / 'compare.json'} (no plots: pip install matplotlib)", file=sys.stderr)
    return 0


def add_arguments(p: argparse.ArgumentParser, config_dir: Path) -> None:
    """``bench compare``'s arguments; its configs default to ``config_dir``'s bench ones."""
    serve.add_arguments(p)
    p.add_argument(
        "--disaggregated",
        nargs="+",
        default=[str(config_dir / "bench_disaggregated.yaml")],
        help="disaggregated config(s), each compared with the colocated one (labelled by file name)",
    )
    p.add_argument("--colocated", default=str(config_dir / "bench_colocated.yaml"))
    p.add_argument(
        "--splits",
        nargs="+",
        type=parse_split,
        default=[],
        metavar="P:D",
        help="disaggregated setups with P prefill and D decode workers on the same cores (e.g. 1:1 2:1)",
    )
    p.add_argument(
        "--cores",
        type=lambda t: [int(c) for c in t.split(",")],
        default=None,
        help="cores the splits share, e.g. 0,1 (default: those the disaggregated config pins to)",
    )
    p.add_argument(
        "--engine",
        nargs="+",
        type=lambda t: parse_engine_options([t]),
        default=[],
        metavar="KEY=VALUE",
        help="engine options set in every setup's pools, e.g. kv_cache_memory_mib=128",
    )
    p.add_argument(
        "--policy",
        nargs="+",
        type=lambda t: parse_engine_options([t]),
        default=[],
        metavar="KEY=VALUE",
        help="router policy options set in every setup, e.g. local_prefill_max_stall_ms=2000",
    )
    p.add_argument("--warmup", type=int, default=3, help="requests sent to each setup before measuring")
    p.add_argument("--out-dir", default="bench-results", help="JSON, plots and server logs go here")
