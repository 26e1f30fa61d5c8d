"""CPU prefill attention: the native paged kernel (``paged_prefill``) against the
SDPA path it replaces, in the same run.

    python -m splitserve.bench.prefill_attention [--engine] [--model smollm2] [--repeats 2]

Kernel part: causal attention over random bf16 K/V placed at random blocks of a
paged cache, SmolLM2's shape (9 query heads, 3 KV heads, head size 64), for
several (prompts x length) batches; prints milliseconds per call, GFLOP/s
(causal: half the square) and the ratio.

``--engine``: the engine end to end (``--model``, SmolLM2 by default; bfloat16
where the CPU has it), 64 prompts x 256 random tokens, 128 output
tokens each (``ignore_eos``), alternating the SDPA prefill and the native one
``--repeats`` times with fresh prompts each run (no prefix-cache hits); prints
output tokens/s and the ratio per pair.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from splitserve.engine import kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = ((1, 256), (8, 256), (64, 256), (4, 512), (1, 1024))


def _timed(fn, n: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def compare(native, seqs: int, n: int, g: torch.Generator) -> tuple[float, float]:
    """Milliseconds per call of the SDPA path and of ``paged_prefill``, for ``seqs``
    fresh prompts of ``n`` tokens each."""
    scale, group, per = HEAD_DIM**-0.5, HEADS // KV_HEADS, n // BLOCK
    blocks = seqs * per + 8
    kc = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    vc = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    table = torch.randperm(blocks, generator=g)[: seqs * per].view(seqs, per)
    q = torch.randn(seqs * n, HEADS, HEAD_DIM, generator=g).bfloat16()
    k = kc[table].reshape(seqs, n, KV_HEADS, HEAD_DIM)
    v = vc[table].reshape(seqs, n, KV_HEADS, HEAD_DIM)
    lens, starts = torch.full((seqs,), n), torch.arange(seqs) * n

    def sdpa() -> None:  # what SdpaBackend does for a prompt with no cached prefix
        for s in range(seqs):
            qs = q[s * n : (s + 1) * n].transpose(0, 1)[None]
            ks = k[s].transpose(0, 1).repeat_interleave(group, dim=0)[None]
            vs = v[s].transpose(0, 1).repeat_interleave(group, dim=0)[None]
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    def paged() -> None:
        native.paged_prefill(q, kc, vc, table, starts, lens, lens, scale)

    return _timed(sdpa), _timed(paged)


def kernel_part() -> None:
    native = kernels.load()
    if native is None or not native.has_paged_prefill():
        raise SystemExit("the native prefill kernel is not built here (needs AVX-512)")
    g = torch.Generator().manual_seed(0)
    head = ("prompts x len", "SDPA ms", "GFLOP/s", "native ms", "GFLOP/s", "ratio")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (14, 9, 8, 10, 8, 7))))
    for seqs, n in SHAPES:
        a, b = compare(native, seqs, n, g)
        gf = seqs * 4 * n * n / 2 * HEAD_DIM * HEADS / 1e6  # causal: half the square
        print(f"{f'{seqs} x {n}':>14} {a:>9.2f} {gf / a:>8.1f} {b:>10.2f} {gf / b:>8.1f} {a / b:>6.2f}x")


def engine_part(model: str, repeats: int) -> None:
    from splitserve.engine.engine import Engine
    from splitserve.loadgen.workloads import random_requests
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams

    engine = Engine(EngineConfig(model=model))
    backend = engine.runner.backend
    if not getattr(backend, "native_prefill", False):
        raise SystemExit(f"the engine's attention backend ({backend.name}) has no native prefill here")
    vocab = engine.model_config.vocab_size
    print(f"\nengine: {engine.dtype}, {torch.get_num_threads()} threads; 64 x 256 in / 128 out")

    def run(native: bool, seed: int) -> float:
        backend.native_prefill = native
        prompts = [r.prompt_ids for r in random_requests(64, 256, 128, vocab_size=vocab, seed=seed)]
        t0 = time.perf_counter()
        done = engine.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True))
        return sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)

    run(True, 1000)
    for i in range(repeats):
        old, new = run(False, 2 * i), run(True, 2 * i + 1)
        print(f"run {i + 1}: SDPA prefill {old:.1f} out tok/s, native {new:.1f}: {new / old:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="store_true", help="also compare the engine end to end")
    ap.add_argument("--model", default="smollm2", help="the engine's model (EngineConfig.model)")
    ap.add_argument("--repeats", type=int, default=2, help="engine runs of each kind, alternating")
    args = ap.parse_args(argv)
    kernel_part()
    if args.engine:
        engine_part(args.model, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
