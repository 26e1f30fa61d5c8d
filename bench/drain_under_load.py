"""Draining a decode worker under load by live migration: what the clients lose
(nothing, is the goal) and how long the drain takes.

    python -m splitserve.bench.drain_under_load [--rate 1] [--duration 180] [--by kv|recompute] [--json PATH]

The default cluster (``cluster_configs/local.yaml``: SmolLM2, one prefill
worker, KV over NIXL) with two decode workers and float32 weights (so that a
greedy output can be compared bit for bit across runs whose batches differ),
on a Ray instance of its own. Two passes of the same open-loop load, the default
workload of ``splitserve bench serve`` (random prompts of 256 tokens, 128
output tokens, greedy, Poisson arrivals at ``--rate`` for ``--duration`` s):
undisturbed, then with ``decode-0`` drained halfway through (the ``Drain``
RPC: ``splitserve drain decode-0``), its requests moving to ``decode-1``.
Reports the failed requests of each pass, the outputs of the drained pass
equal to the undisturbed one's, the requests moved, and the drain's duration
against the longest generation of the pass (what waiting for it would have
taken at least).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from splitserve.bench import harness
from splitserve.client import AsyncClient
from splitserve.cluster.config import ClusterConfig
from splitserve.loadgen import workloads
from splitserve.loadgen.serve import send_one


async def one_pass(address: str, requests, arrivals, drain_at: float | None, by: str):
    """Every request at its arrival; with ``drain_at`` (s from the start), decode-0
    drained then. Returns (records, tokens, the drain's response and seconds)."""
    async with AsyncClient(address, retries=0, timeout=600.0) as client:
        start = time.perf_counter()

        async def request(req, at):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send_one(client, req.prompt_ids, req.output_len)

        async def drain():
            await asyncio.sleep(max(0.0, start + drain_at - time.perf_counter()))
            t0 = time.perf_counter()
            response = await client.drain("decode-0", by)
            return response, time.perf_counter() - t0

        drained = asyncio.ensure_future(drain()) if drain_at is not None else None
        sent = await asyncio.gather(*(request(r, t) for r, t in zip(requests, arrivals)))
        drain_result = await drained if drained is not None else (None, 0.0)
    records = [rec for rec, _ in sent]
    return records, [tokens for _, tokens in sent], *drain_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of arrivals per pass")
    ap.add_argument("--by", choices=["kv", "recompute"], default="kv")
    harness.add_json_argument(ap)
    args = ap.parse_args(argv)
    config = ClusterConfig.model_validate(
        {
            "model": {"name": "smollm2", "dtype": "float32"},
            "decode": {"replicas": 2, "num_cpus": 0.5},
            "prefill": {"num_cpus": 1},
            "router": {"port": 0, "http_port": None},
        }
    )
    n = max(2, int(args.rate * args.duration))
    with harness.served(config) as cluster:
        v = cluster.dispatcher.validator
        requests = workloads.random_requests(n, 256, 128, v.vocab_size, seed=0)
        arrivals = workloads.arrival_times(n, args.rate, seed=0)
        ref, ref_tokens, _, _ = asyncio.run(one_pass(cluster.address, requests, arrivals, None, args.by))
        got, tokens, drained, drain_s = asyncio.run(
            one_pass(cluster.address, requests, arrivals, args.duration / 2, args.by)
        )
    failed = [sum(not r.success for r in records) for records in (ref, got)]
    equal = sum(a == b for a, b in zip(ref_tokens, tokens))
    longest = max(r.chunk_times[-1] - r.send_time for r in got if r.chunk_times)
    rows = [
        ["requests per pass", n],
        ["failed, undisturbed pass", failed[0]],
        ["failed, drained pass", failed[1]],
        ["outputs equal to the undisturbed pass", f"{equal}/{n}"],
        ["requests moved off decode-0", drained.moved],
        ["requests left on decode-0", drained.left],
        ["drain took (s)", round(drain_s, 2)],
        ["longest generation of the pass (s)", round(longest, 2)],
    ]
    load = f"{args.rate:g} req/s for {args.duration:g} s"
    print(f"SmolLM2 float32, 1 prefill + 2 decode workers, {load}, moving by {args.by}")
    print(harness.table(["", "value"], rows))
    harness.report(
        "drain under load: drain seconds / longest generation",
        drain_s / longest,
        args.json,
        rows=rows,
        failed=failed,
        equal=equal,
        n=n,
    )
    return 0 if failed == [0, 0] and equal == n else 1


if __name__ == "__main__":
    sys.exit(main())
