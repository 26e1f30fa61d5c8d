"""The handoff of a sliding-window model against a full-attention one of the same shape.

gpt-oss-20b's KV shape (24 layers, alternating sliding (128-token window) and
full, 8 KV heads of 64, bfloat16, 16-token blocks), and its twin without windows.
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
import statistics
import sys
import time

import torch

from splitserve.bench.kv_peers import ExportRandom, SourceSpec, start_source
from splitserve.kv_transfer import get_backend
from splitserve.wire.kv import CompatInfo
from splitserve.wire.kv_layout import KVLayout

WINDOW = 128
BLOCK = 16
SHAPE = dict(num_layers=24, num_kv_heads=8, head_dim=64)  # gpt-oss-20b
WINDOWS = tuple(WINDOW if i % 2 == 0 else 0 for i in range(24))  # its layer_types: sliding first


def pull(layout: KVLayout, tokens: int, repeats: int, backend: str) -> tuple[int, float]:
    """(bytes moved, median seconds of a pull) of ``tokens`` tokens' KV under ``layout``."""
    nblocks = layout.num_blocks
    src = start_source(SourceSpec(backend, layout=layout))
    try:
        cache = torch.zeros(
            layout.num_layers, 2, nblocks, BLOCK, layout.num_kv_heads, layout.head_dim, dtype=torch.bfloat16
        )
        sink = get_backend(backend).sink("bench-decode", cache, CompatInfo(model="random", layout=layout))
        sink.connect(src.handshake)
        times, moved = [], 0
        wf = layout.window_from(0, tokens)
        for _ in range(repeats + 1):  # the first also sets up the connection: not counted
            desc = src.call(ExportRandom(num_tokens=tokens, window_from=wf)).descriptor
            t0 = time.perf_counter()
            sink.pull(desc, list(range(len(desc.block_ids))), timeout=120.0)
            times.append(time.perf_counter() - t0)
            moved = sink.last_stats.num_bytes
        sink.close()
    finally:
        src.stop()
    return moved, statistics.median(times[1:])


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
        windowed = KVLayout(num_blocks=nblocks, block_size=BLOCK, dtype="bfloat16", windows=WINDOWS, **SHAPE)
        full = KVLayout(num_blocks=nblocks, block_size=BLOCK, dtype="bfloat16", **SHAPE)
        wb, wt = pull(windowed, tokens, args.repeats, args.backend)
        fb, ft = pull(full, tokens, args.repeats, args.backend)
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
