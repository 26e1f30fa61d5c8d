"""``splitserve bench compare``: the same workload against a disaggregated and
a colocated cluster on equal resources, one after the other, and the ratios.

    splitserve bench compare --dataset mixed --num-prompts 120 --request-rate 1 2 3 \\
        --goodput tpot:150 --out-dir bench-results/

Each setup is a real ``splitserve serve`` process (its own Ray instance,
router and workers), started from a config, warmed up, measured at every
rate, then stopped with SIGINT. The defaults are
``cluster_configs/bench_disaggregated.yaml`` (1 prefill + 1 decode worker) and
``cluster_configs/bench_colocated.yaml`` (2 colocated workers): each worker
one core, pinned, one torch thread.

Ratios are disaggregated ÷ colocated: below 1 is better for latencies, above
1 is better for goodput, attainment and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from splitserve.bench import serve_bench
from splitserve.client import Client
from splitserve.cluster.config import CONFIG_DIR

RATIO_KEYS = (
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
            "splitserve.cluster.cli",
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
            c.generate(list(range(100, 164 + 64 * i)), max_tokens=8, ignore_eos=True)


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


def print_ratios(rows: list[dict], disagg: list, coloc: list) -> None:
    print(
        "\n==== disaggregated ÷ colocated "
        "(latencies: < 1 is better; goodput, attainment, throughput: > 1 is better) ===="
    )
    keys = [k for k in RATIO_KEYS if k in rows[0]]
    print(f"{'rate':>6} " + " ".join(f"{k:>16}" for k in keys))
    for row in rows:
        print(f"{row['request_rate']:>6g} " + " ".join(f"{row[k]:>16.3f}" for k in keys))
    print("\nabsolute values (disaggregated / colocated):")
    for d, c in zip(disagg, coloc):
        cells = [f"{k}={d.metrics[k]:.1f}/{c.metrics[k]:.1f}" for k in keys if k in d.metrics]
        print(f"  rate {d.rate:g}: " + ", ".join(cells))


def main(args: argparse.Namespace) -> int:
    from splitserve.bench import plots

    out = Path(args.out_dir)
    runs = {}
    for label, config in (("disaggregated", args.disaggregated), ("colocated", args.colocated)):
        print(f"---- {label}: starting splitserve serve --config {config}", file=sys.stderr)
        server = Server(config, out / f"{label}.log")
        try:
            warm_up(server.address, args.warmup)
            runs[label] = asyncio.run(serve_bench.run_rates(args, server.address))
        finally:
            server.stop()
        for r in runs[label]:
            serve_bench.print_summary(label, r.metrics)
    rows = ratios(runs["disaggregated"], runs["colocated"])
    print_ratios(rows, runs["disaggregated"], runs["colocated"])
    serve_bench.write_json(
        str(out / "compare.json"),
        {"args": {k: v for k, v in vars(args).items() if k != "func"}, "ratios": rows}
        | {label: [r.metrics for r in results] for label, results in runs.items()},
    )
    plots.write_all(str(out), runs, serve_bench.parse_goodput(args.goodput))
    print(f"\nwrote {out / 'compare.json'} and plots in {out}/", file=sys.stderr)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve_bench.add_arguments(p)
    p.add_argument("--disaggregated", default=str(CONFIG_DIR / "bench_disaggregated.yaml"))
    p.add_argument("--colocated", default=str(CONFIG_DIR / "bench_colocated.yaml"))
    p.add_argument("--warmup", type=int, default=3, help="requests sent to each setup before measuring")
    p.add_argument("--out-dir", default="bench-results", help="JSON, plots and server logs go here")
