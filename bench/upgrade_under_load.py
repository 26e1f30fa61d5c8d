"""A rolling upgrade under load: every worker replaced by one of a second revision of
the model while clients keep sending, and what they saw.

    python -m splitserve.bench.upgrade_under_load [--rate 1] [--duration 180] [--json PATH]

The default cluster (``cluster_configs/local.yaml``: SmolLM2, one prefill and one
decode worker, KV over NIXL; half a CPU per worker, so that the old and the new
workers fit the machine together during the upgrade) on a Ray instance of its
own. The second revision is SmolLM2's checkpoint copied with its largest
tensor changed by one ulp (another revision to the compatibility hash, nearly
the same outputs). Open-loop load, the default workload of ``splitserve bench
serve`` (random prompts of 256 tokens, 128 output tokens, greedy, Poisson
arrivals at ``--rate``) for ``--duration`` s; at a third of it, ``splitserve
upgrade --model`` the copy. Reports failed requests, requests whose two phases
ran on different revisions (from the router's traces: none, is the goal), and
the p99 TTFT of the requests sent before the upgrade began against those sent
while it ran (goal: <= 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from splitserve.bench import harness
from splitserve.client import AsyncClient
from splitserve.cluster.config import ClusterConfig
from splitserve.engine.model.loader import resolve_source
from splitserve.loadgen import workloads
from splitserve.loadgen.serve import send_one


def second_revision(directory: Path) -> Path:
    """SmolLM2's converted checkpoint copied into ``directory`` with its largest tensor
    nudged by one ulp."""
    copy = directory / "smollm2-r2"
    shutil.copytree(resolve_source("smollm2").directory, copy)
    path = copy / "model.safetensors"
    tensors = load_file(str(path))
    name = max(tensors, key=lambda k: tensors[k].numel())  # the largest: its bytes span sampled chunks
    tensors[name] = torch.nextafter(tensors[name], torch.tensor(float("inf")))
    save_file(tensors, str(path), metadata={"format": "pt"})
    return copy


async def run(address: str, requests, arrivals, upgrade_at: float, model: str):
    """The load, with the upgrade started at ``upgrade_at`` s; (records, the upgrade's
    start and end on the records' clock, the traces, its response)."""
    async with AsyncClient(address, retries=0, timeout=900.0) as client:
        start = time.perf_counter()

        async def request(req, at):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            rec, _ = await send_one(client, req.prompt_ids, req.output_len)
            return rec

        async def upgrade():
            await asyncio.sleep(max(0.0, start + upgrade_at - time.perf_counter()))
            began = time.perf_counter()
            response = await client.upgrade(model=model)
            return began, time.perf_counter(), response

        upgrading = asyncio.ensure_future(upgrade())
        records = await asyncio.gather(*(request(r, t) for r, t in zip(requests, arrivals)))
        began, ended, response = await upgrading
        status = await client.cluster_status(traces=len(requests))
    return records, began, ended, status.traces, response


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else (values[0] if values else 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of arrivals")
    harness.add_json_argument(ap)
    args = ap.parse_args(argv)
    n = max(3, int(args.rate * args.duration))
    config = ClusterConfig.model_validate(
        {
            "model": {"name": "smollm2"},
            "prefill": {"num_cpus": 0.5, "torch_threads": 1},
            "decode": {"num_cpus": 0.5, "torch_threads": 1},
            "router": {"port": 0, "http_port": None, "traces_kept": n + 16},
        }
    )
    with tempfile.TemporaryDirectory(prefix="upgrade-") as tmp, harness.served(config) as cluster:
        model = str(second_revision(Path(tmp)))
        v = cluster.dispatcher.validator
        requests = workloads.random_requests(n, 256, 128, v.vocab_size, seed=0)
        arrivals = workloads.arrival_times(n, args.rate, seed=0)
        records, began, ended, traces, response = asyncio.run(
            run(cluster.address, requests, arrivals, args.duration / 3, model)
        )
    failed = sum(not r.success for r in records)
    mixed = [t.request_id for t in traces if t.prefill_revision and t.prefill_revision != t.decode_revision]
    ttft = {"steady": [], "upgrading": []}
    for r in records:
        if r.success:
            phase = "steady" if r.send_time < began else "upgrading" if r.send_time < ended else None
            if phase is not None:
                ttft[phase].append(r.chunk_times[0] - r.send_time)
    steady, during = p99(ttft["steady"]), p99(ttft["upgrading"])
    rows = [
        ["requests", n],
        ["failed", failed],
        ["prefilled by one revision, decoded by another", len(mixed)],
        ["workers started / stopped", f"{len(response.started)} / {len(response.removed)}"],
        ["upgrade took (s)", round(ended - began, 1)],
        ["requests sent before / during it", f"{len(ttft['steady'])} / {len(ttft['upgrading'])}"],
        ["p99 TTFT before (s)", round(steady, 3)],
        ["p99 TTFT during (s)", round(during, 3)],
    ]
    print(f"SmolLM2 bf16/auto, 1 prefill + 1 decode worker, {args.rate:g} req/s for {args.duration:g} s")
    print(harness.table(["", "value"], rows))
    ratio = during / steady if steady else float("inf")
    harness.report(
        "rolling upgrade under load: p99 TTFT during / before (goal <= 2)",
        ratio,
        args.json,
        rows=rows,
        failed=failed,
        mixed=mixed,
    )
    return 0 if failed == 0 and not mixed else 1


if __name__ == "__main__":
    sys.exit(main())
