"""Prefill through one Gated DeltaNet layer: ``engine.model.deltanet`` against
transformers' own layer (its torch fallback: no ``fla`` kernels on a CPU), the same
weights and tokens, alternated in one run.

Qwen3-Next-80B-A3B's linear-attention shape (hidden 2048, 16 key heads and 32 value
heads of 128, a 4-wide convolution), random weights. Per prompt length and dtype,
the best of ``--repeats`` forward passes of one sequence through the layer (its
projections, convolution, chunked delta rule, gated norm and output projection),
as tokens/s, and ours / transformers'::

    python -m splitserve.bench.deltanet_bench
    python -m splitserve.bench.deltanet_bench --tokens 512 --repeats 2
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch

from splitserve.engine.model.deltanet import DeltaShape, DeltaSpan, DeltaStates, GatedDeltaNet, as_ours

SHAPE = DeltaShape(hidden=2048, k_heads=16, v_heads=32, dk=128, dv=128, conv_width=4, eps=1e-6)


def layers(dtype: torch.dtype):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    s = SHAPE
    cfg = Qwen3NextConfig(
        hidden_size=s.hidden,
        linear_num_key_heads=s.k_heads,
        linear_num_value_heads=s.v_heads,
        linear_key_head_dim=s.dk,
        linear_value_head_dim=s.dv,
        linear_conv_kernel_dim=s.conv_width,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    theirs = Qwen3NextGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    ours = GatedDeltaNet(s, fused=True)
    ours.load_state_dict(as_ours(theirs.state_dict()))
    return theirs.to(dtype), ours.to(dtype)


def forward_theirs(layer, x: torch.Tensor) -> None:
    with torch.no_grad():
        layer(x)


def forward_ours(layer: GatedDeltaNet, x: torch.Tensor, dtype: torch.dtype) -> None:
    """A fresh sequence (zero states) through ``layer``: a prefill, states included."""
    s = SHAPE
    states = DeltaStates.empty(2, s.conv_channels, s.conv_width, s.v_heads, s.dk, s.dv, dtype)
    with torch.no_grad():
        layer(x, [DeltaSpan(0, x.shape[0], 0, 1, fresh=True)], states)


def best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print("| dtype | prompt tokens | transformers tok/s | splitserve tok/s | ours / transformers |")
    print("|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        theirs, ours = layers(dtype)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(1, tokens, SHAPE.hidden).to(dtype)

            run_theirs = functools.partial(forward_theirs, theirs, x)
            run_ours = functools.partial(forward_ours, ours, x[0], dtype)
            t_theirs, t_ours = best(run_theirs, args.repeats), best(run_ours, args.repeats)
            rates = f"{tokens / t_theirs:,.0f} | {tokens / t_ours:,.0f}"
            print(f"| {name} | {tokens} | {rates} | {t_theirs / t_ours:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
