"""The sampler alone: milliseconds per call for a batch of logits, per kind of row
(greedy, temperature, top-p, top-p with a seed, top-k), and each against the greedy
row of the same run (what a sampled step costs beyond a greedy one).

    python -m splitserve.bench.sampler_bench                    # 16 x 49,152 bf16 (SmolLM2's vocabulary)
    python -m splitserve.bench.sampler_bench --batch 64 --vocab 128256
"""

from __future__ import annotations

import argparse
import time

import torch

from splitserve.engine.sampler import Sampler, SampleRequest
from splitserve.wire.sampling import SamplingParams

KINDS = {
    "greedy": SamplingParams(max_tokens=4),
    "temperature 0.8": SamplingParams(max_tokens=4, temperature=0.8),
    "top_p 0.9": SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9),
    "top_p 0.9, seeded": SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1),
    "top_k 50": SamplingParams(max_tokens=4, temperature=0.8, top_k=50),
}


def per_call_ms(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, calls: int) -> float:
    rows = [SampleRequest(params, i) for i in range(logits.shape[0])]
    sampler(logits, rows)  # warm
    start = time.perf_counter()
    for _ in range(calls):
        sampler(logits, rows)
    return (time.perf_counter() - start) / calls * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    # a language model's spread: most of the mass on a few hundred tokens
    logits = (torch.randn(args.batch, args.vocab, generator=g) * 3).to(getattr(torch, args.dtype))
    sampler = Sampler(seed=0)
    times = {name: per_call_ms(sampler, logits, p, args.calls) for name, p in KINDS.items()}
    print(f"sampler, {args.batch} x {args.vocab} {args.dtype} logits, {torch.get_num_threads()} threads")
    for name, ms in times.items():
        print(f"  {name:<20} {ms:7.2f} ms   {ms / times['greedy']:5.1f}x greedy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
