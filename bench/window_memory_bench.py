"""The KV memory a sliding-window model's request holds, in layer groups, against its
full-attention twin.

gpt-oss-20b's attention shape (24 layers alternating sliding, with a 128-token
window, and full; 8 KV heads of 64; bfloat16; 16-token blocks) on a random-weight
model small everywhere else (KV memory depends on nothing else), and the same model
with every layer full. One engine each, the same KV budget; one request of
``--tokens`` prompt tokens prefilled in chunks of ``--chunk`` and decoded for
``--decode`` tokens. Measured from the engine's own block manager after every step:
the KV bytes the request holds (blocks held x a block's bytes over the cache's
rows), the most at any step, and how many such requests the budget holds at once
(its blocks over the most one held)::

    python -m splitserve.bench.window_memory_bench                  # 4k prompt, 128 window
    python -m splitserve.bench.window_memory_bench --tokens 16384 --chunk 2048
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import GptOssConfig

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams

LAYERS, WINDOW, BLOCK = 24, 128, 16


def model_config(windowed: bool) -> GptOssConfig:
    kinds = ["sliding_attention" if windowed and i % 2 == 0 else "full_attention" for i in range(LAYERS)]
    return GptOssConfig(
        vocab_size=2048,
        hidden_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=kinds,
        max_position_embeddings=131072,  # gpt-oss-20b's
    )


def measure(windowed: bool, tokens: int, decode: int, chunk: int, budget_mib: int) -> dict:
    """Bytes the request holds after its prefill, at its end, and the most at any step."""
    cfg = EngineConfig(
        model="bench",
        random_weights=True,
        dtype="bfloat16",
        block_size=BLOCK,
        kv_cache_memory_mib=budget_mib,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )
    engine = Engine(cfg, model_config(windowed))
    layout = engine.kv_cache.layout
    per_block = layout.rows * layout.planes * layout.block_bytes
    ids = torch.randint(100, 2048, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request(ids, SamplingParams(max_tokens=decode, ignore_eos=True))
    bm = engine.block_manager
    held, prefilled = [], None
    while engine.has_unfinished():
        outputs = engine.step()
        held.append(bm.num_used_blocks)
        if prefilled is None and any(o.new_token_ids for o in outputs):
            prefilled = bm.num_used_blocks
    last = held[-2] if len(held) > 1 else held[-1]  # the step before the one that freed it all
    return {
        "prefilled": prefilled * per_block,
        "end": last * per_block,
        "peak": max(held) * per_block,
        "fits": bm.num_blocks // max(held),
        "budget": bm.num_blocks * per_block,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--budget-mib", type=int, default=1024)
    args = ap.parse_args(argv)
    w = measure(True, args.tokens, args.decode, args.chunk, args.budget_mib)
    f = measure(False, args.tokens, args.decode, args.chunk, args.budget_mib)
    mb = 1e6
    print(f"{args.tokens}-token prompt, {args.decode} decoded, chunks of {args.chunk}, {WINDOW}-token window")
    print("| KV held by the request | layer groups MB | full attention MB | groups / full |")
    print("|---|---|---|---|")
    for key, name in (("prefilled", "after its prefill"), ("end", "at its last token"), ("peak", "the most")):
        print(f"| {name} | {w[key] / mb:.1f} | {f[key] / mb:.1f} | {w[key] / f[key]:.3f} |")
    print(
        f"| such requests a {w['budget'] / mb:.0f} MB cache holds at once | {w['fits']} | {f['fits']} "
        f"| {w['fits'] / max(f['fits'], 1):.2f}x |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
