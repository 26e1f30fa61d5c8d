"""Serving-path efficiency: what the cluster around an engine costs.

One colocated worker given every core of the machine serves ``--requests``
requests sent at once through the asyncio gRPC SDK (random prompts of
``--input-len`` tokens, ``--output-len`` output tokens each, greedy,
``ignore_eos``). Then, in this process and with the cluster stopped, the same
engine config generates the same requests offline in one ``generate`` call.
Prints both output tokens/s and their ratio (served / offline), measured in
the same run; the serving path is "free" at 1.0.

    python -m splitserve.bench.serving_efficiency                      # SmolLM2, 48 x 256/128
    python -m splitserve.bench.serving_efficiency --requests 16 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import ray

from splitserve.bench.workloads import random_requests
from splitserve.client import AsyncClient
from splitserve.cluster.app import BackgroundCluster
from splitserve.cluster.config import ClusterConfig
from splitserve.engine import Engine, SamplingParams
from splitserve.engine.model.loader import load_hf_config, resolve_source


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def served(config: ClusterConfig, prompts: list[list[int]], output_len: int, cpus: int) -> float:
    """Output tokens/s of the whole batch through router, Ray and the worker."""
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        with BackgroundCluster(config) as cluster:
            asyncio.run(_generate(cluster.address, prompts[:2], 8))  # warm-up
            t0 = time.perf_counter()
            tokens = asyncio.run(_generate(cluster.address, prompts, output_len))
            elapsed = time.perf_counter() - t0
    finally:
        ray.shutdown()
    if tokens != len(prompts) * output_len:
        raise RuntimeError(f"expected {len(prompts) * output_len} output tokens, got {tokens}")
    return tokens / elapsed


async def _generate(address: str, prompts: list[list[int]], output_len: int) -> int:
    client = AsyncClient(address, timeout=3600)
    try:
        outs = await asyncio.gather(
            *(client.generate(p, max_tokens=output_len, ignore_eos=True) for p in prompts)
        )
    finally:
        await client.close()
    return sum(len(o.token_ids) for o in outs)


def offline(config: ClusterConfig, prompts: list[list[int]], output_len: int) -> float:
    engine = Engine(config.engine_config("colocated"))
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    done = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(c.token_ids) for c in done) / elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cpus = os.cpu_count() or 1
    config = ClusterConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"name": args.model},
            "colocated": {"replicas": 1, "num_cpus": cpus},
            "router": {"port": 0, "http_port": None},
        }
    )
    engine_cfg = config.engine_config("colocated")
    vocab = load_hf_config(resolve_source(args.model)).vocab_size
    reqs = random_requests(args.requests, args.input_len, args.output_len, vocab_size=vocab, seed=args.seed)
    prompts = [r.prompt_ids for r in reqs]
    log(f"served: one colocated worker with {cpus} CPUs ...")
    served_tps = served(config, prompts, args.output_len, cpus)
    log("offline: the same engine config in this process ...")
    offline_tps = offline(config, prompts, args.output_len)
    print(
        f"model {args.model}, {args.requests} requests x {args.input_len}/{args.output_len} tokens, "
        f"{cpus} CPUs, max_num_seqs {engine_cfg.max_num_seqs}"
    )
    print(f"{'path':<8} {'output tok/s':>12}")
    print(f"{'offline':<8} {offline_tps:>12.1f}")
    print(f"{'served':<8} {served_tps:>12.1f}")
    print(f"served / offline = {served_tps / offline_tps:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
