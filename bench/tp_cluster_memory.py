"""A real-shape model served with TP groups in both pools: what each process holds.

Generates (once, never committed; ``load_bench.write_checkpoint``) a random-weight
bf16 checkpoint with a real model's config, starts a disaggregated cluster on
this machine's Ray whose prefill and decode workers are TP groups (``--prefill-tp``,
``--decode-tp``), streams a few greedy requests through the gRPC client (checking
every stream against a TP=1 engine when ``--check``), and prints each worker
process's resident anonymous memory (``RssAnon``: what the process allocated,
not the checkpoint pages it maps), beside its model shard and KV cache::

    python -m splitserve.bench.tp_cluster_memory --shape llama3.2-3b --dir /tmp/llama3.2-3b-random

Every worker process is found by its Ray process title (``ray::DecodeRank`` ...).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from splitserve.bench.load_bench import SHAPES, rss_anon, write_checkpoint

GIB = 2**30
TITLES = ("PrefillWorker", "PrefillRank", "DecodeWorker", "DecodeRank")


def worker_processes() -> dict[int, str]:
    """Ray worker processes of this machine hosting a splitserve worker: pid -> class name."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for title in TITLES:
            if cmdline.startswith(f"ray::{title}"):
                found[int(entry)] = title
    return found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3.2-3b")
    ap.add_argument("--dir", type=Path, required=True, help="where the random checkpoint is (or goes)")
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=2)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the engines' dtype")
    ap.add_argument("--kv-mib", type=int, default=256, help="KV cache per rank (MiB)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--check", action="store_true", help="compare every stream with a TP=1 engine's")
    args = ap.parse_args(argv)

    from splitserve.bench import harness
    from splitserve.client import Client
    from splitserve.cluster.config import ClusterConfig
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams

    write_checkpoint(args.dir, args.shape, shard_gib=2.0)
    engine = {"kv_cache_memory_mib": args.kv_mib, "max_num_batched_tokens": 512}
    ncpu = os.cpu_count() or 2
    per_rank = ncpu / (args.prefill_tp + args.decode_tp)
    config = ClusterConfig.model_validate(
        {
            "policy": {"conditional_disaggregation": False},
            "model": {"name": str(args.dir), "dtype": args.dtype, "max_model_len": 2048},
            "prefill": {"num_cpus": per_rank, "tp_size": args.prefill_tp, "engine": engine},
            "decode": {"num_cpus": per_rank, "tp_size": args.decode_tp, "engine": engine},
            "router": {"port": 0, "http_port": 0},
        }
    )
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(16 + 24 * i)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    with harness.served(config, ncpu, object_store_memory=300 * 2**20) as cluster:
        print(f"cluster up in {time.perf_counter() - t0:.0f} s", flush=True)
        with Client(cluster.address, timeout=600) as client:
            outs = [
                client.generate(p, temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
                for p in prompts
            ]
            status = client.cluster_status()
        procs = worker_processes()
        rows = sorted((title, pid, rss_anon(pid)) for pid, title in procs.items())
    shard_gib = sum(f.stat().st_size for f in args.dir.glob("*.safetensors")) / GIB
    tp = f"prefill TP={args.prefill_tp}, decode TP={args.decode_tp}"
    print(f"\n{args.shape}: checkpoint {shard_gib:.2f} GiB bf16, run in {args.dtype}; {tp}; "
          f"KV cache {args.kv_mib} MiB per rank")  # fmt: skip
    print("process         pid      RssAnon GiB")
    for title, pid, anon in rows:
        print(f"{title:<14} {pid:>7}  {anon / GIB:>10.2f}")
    total = sum(anon for *_, anon in rows)
    print(f"all {len(rows)} worker processes: {total / GIB:.2f} GiB (the model twice, once per pool: "
          f"{2 * shard_gib:.2f} GiB)")  # fmt: skip
    for pool in status.pools:
        print(f"{pool.role}: {len(pool.workers)} worker(s)")
    for o in outs:
        f = o.final
        print(f"  {f.prompt_tokens:>4} prompt tokens: prefill {f.prefill_worker}, decode {f.decode_worker}, "
              f"ttft {f.ttft_ms:.0f} ms, kv pull {f.kv_pull_ms:.0f} ms, tokens {o.token_ids}")  # fmt: skip
    if args.check:
        ref = Engine(
            EngineConfig(
                model=str(args.dir), dtype=args.dtype, kv_cache_memory_mib=args.kv_mib, max_model_len=2048
            )
        )
        expected = [c.token_ids for c in ref.generate(prompts, params)]
        same = sum(o.token_ids == e for o, e in zip(outs, expected))
        print(f"greedy tokens equal to a TP=1 engine's: {same}/{len(prompts)}")
        for o, e in zip(outs, expected):
            agree = next((i for i, (a, b) in enumerate(zip(o.token_ids, e)) if a != b), len(e))
            print(f"  first {agree} of {len(e)} tokens agree; TP=1 engine: {e}")


if __name__ == "__main__":
    main()
