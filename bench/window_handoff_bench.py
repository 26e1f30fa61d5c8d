"""The handoff of a sliding-window model against a full-attention one of the same shape.

gpt-oss-20b's KV shape (24 layers, alternating sliding (128-token window) and
full, 8 KV heads of 64, bfloat16, 16-token blocks) in layer groups as the engine
lays it out (``KVLayout.grouped``: the sliding layers in blocks of their own),
and its twin without windows.
For each prompt length a source process (``kv_peers``, a pool of random bytes)
exports one request's blocks as a prefill worker does (``KVLayout.window_from``:
the sliding layers' blocks from the one holding key ``tokens - 128 + 1`` on) and
this process pulls them over nixl (verified, as every pull is). Per length: the
bytes the export names and the sink moved (``TransferStats.num_bytes``), what the
layers need (the full layers' every token, the sliding layers' last 128 plus the
rest of their first block), and the median pull time of ``--repeats``, windowed
against full in the same run::

    python -m splitserve.bench.window_handoff_bench                # 1k, 4k, 16k tokens
    python -m splitserve.bench.window_handoff_bench --tokens 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import sys

from splitserve.bench.kv_peers import timed_pulls
from splitserve.wire.kv_layout import KVLayout

WINDOW = 128
BLOCK = 16
SHAPE = dict(num_layers=24, num_kv_heads=8, head_dim=64)  # gpt-oss-20b
WINDOWS = tuple(WINDOW if i % 2 == 0 else 0 for i in range(24))  # its layer_types: sliding first


def needed_bytes(layout: KVLayout, tokens: int) -> int:
    """What the layers need: each full layer every token's block, each sliding layer the
    blocks from the one holding key ``tokens - window + 1`` to the last."""
    blocks = -(-tokens // BLOCK)
    first = max(0, tokens - WINDOW + 1) // BLOCK
    per_layer = [blocks - (first if layout.windowed(i) else 0) for i in range(layout.num_layers)]
    return sum(per_layer) * layout.planes * layout.block_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="nixl")
    args = ap.parse_args(argv)
    print(
        "| prompt tokens | windowed MB | needed MB | full-attention MB | bytes windowed / full "
        "| windowed pull ms | full pull ms | time windowed / full |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        nblocks = -(-tokens // BLOCK)
        windowed = KVLayout(
            num_blocks=2 * nblocks, block_size=BLOCK, dtype="bfloat16", windows=WINDOWS, grouped=True, **SHAPE
        )
        full = KVLayout(num_blocks=nblocks, block_size=BLOCK, dtype="bfloat16", **SHAPE)
        wb, wt = timed_pulls(windowed, tokens, args.repeats, args.backend, windowed.window_from(0, tokens))
        fb, ft = timed_pulls(full, tokens, args.repeats, args.backend)
        need = needed_bytes(windowed, tokens)
        print(
            f"| {tokens} | {wb / 1e6:.1f} | {need / 1e6:.1f} | {fb / 1e6:.1f} | {wb / fb:.3f} "
            f"| {wt * 1e3:.1f} | {ft * 1e3:.1f} | {wt / ft:.2f} |",
            flush=True,
        )
        if wb != need:
            print(f"windowed handoff moved {wb} bytes, the layers need {need}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
