"""The handoff of a hybrid model (KV of its full layers, and its linear layers'
states) against a full-attention model of the same shape.

Qwen3-Next-80B-A3B's shapes (48 layers, every 4th full attention with 2 KV heads of
256, the other 36 Gated DeltaNet with 32 value heads of 128x128 state, bf16,
16-token blocks): what one request's handoff moves is its KV blocks of the 12 full
layers plus its state slot's blocks (``engine.state_blocks``, laid out as the engine
lays them out), against the twin whose 48 layers all keep KV. For each prompt
length a source process (``kv_peers``, a pool of random bytes of that layout)
exports the blocks and this process pulls them over nixl, verified; the median pull
of ``--repeats``, both in the same run::

    python -m splitserve.bench.hybrid_handoff_bench
    python -m splitserve.bench.hybrid_handoff_bench --tokens 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import sys

import torch

from splitserve.bench.kv_peers import timed_pulls
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.state_blocks import plan_states
from splitserve.wire.kv_layout import KVLayout

BLOCK = 16


def shapes() -> tuple[ModelConfig, KVLayout, int]:
    """(the hybrid config, its KV layout without blocks, its state slot's blocks)."""
    from transformers import Qwen3NextConfig

    cfg = ModelConfig.from_hf(Qwen3NextConfig())  # the released 80B-A3B's shapes
    layout = KVLayout(len(cfg.kv_layers), 0, BLOCK, cfg.num_kv_heads, cfg.head_dim, "bfloat16")
    plan = plan_states(cfg, layout, torch.bfloat16)
    return cfg, layout, plan.blocks_per_slot


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="nixl")
    args = ap.parse_args(argv)
    cfg, layout, state_blocks = shapes()
    state_mb = state_blocks * layout.block_bytes * layout.planes * layout.num_layers / 1e6
    print(f"state slot: {state_blocks} blocks on each of {layout.num_layers} KV layers: {state_mb:.1f} MB")
    print(
        "| prompt tokens | hybrid MB (KV + state) | full-attention MB | hybrid / full "
        "| hybrid bytes per token | full bytes per token | hybrid pull ms | full pull ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        kv_blocks = -(-tokens // BLOCK)
        hybrid = KVLayout(
            layout.num_layers,
            kv_blocks + state_blocks,
            BLOCK,
            layout.num_kv_heads,
            layout.head_dim,
            "bfloat16",
        )
        full = KVLayout(cfg.num_layers, kv_blocks, BLOCK, layout.num_kv_heads, layout.head_dim, "bfloat16")
        hb, ht = timed_pulls(hybrid, (kv_blocks + state_blocks) * BLOCK, args.repeats, args.backend)
        fb, ft = timed_pulls(full, kv_blocks * BLOCK, args.repeats, args.backend)
        print(
            f"| {tokens} | {hb / 1e6:.1f} | {fb / 1e6:.1f} | {hb / fb:.3f} | {hb / tokens:,.0f} "
            f"| {fb / tokens:,.0f} | {ht * 1e3:.1f} | {ft * 1e3:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
