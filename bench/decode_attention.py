"""The paged-decode attention kernel's launch shape on this GPU: GB/s of K/V read
per tile width, warp count and context split, bf16 and FP8 (e4m3) caches, against
the defaults.

    python -m splitserve.bench.decode_attention --context 4096 --batch 1 64 [--split-factors 1 2 4 8]

Llama-3-8B's heads (32 query, 8 KV, dim 128), random K/V, one query token per
sequence, the splits ``choose_splits`` picks times each split factor (more
programs in flight per multiprocessor); each row is the median of 10 timed
calls by CUDA events. The bytes are the K/V the kernel must read (the roofline of
the attention alone); an FP8 cache halves them, so at equal GB/s its step takes
half the time. Needs CUDA.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

BLOCK_SIZE = 16
TILES = (32, 64, 128, 256)
WARPS = (4, 8)
SPLIT_FACTORS = (1,)  # times choose_splits' pick


@dataclass(frozen=True)
class Row:
    kv_dtype: str
    batch: int
    context: int
    tile_keys: int
    num_warps: int
    splits: int
    ms: float
    gbps: float
    default: bool  # the launch shape paged_decode picks by itself


def sweep(
    batches: tuple[int, ...],
    context: int,
    kv_dtypes: tuple[str, ...] = ("bf16", "fp8"),
    heads: int = 32,
    kv_heads: int = 8,
    dim: int = 128,
    log: Callable[[str], None] = print,
    tiles: tuple[int, ...] = TILES,
    warps: tuple[int, ...] = WARPS,
    split_factors: tuple[int, ...] = SPLIT_FACTORS,
) -> list[Row]:
    """Every (KV dtype, batch, tile, warps, splits) launch, timed; the default shape's
    row carries ``default``. A shape this GPU cannot run (registers, shared memory) is
    logged and skipped."""
    from splitserve.bench.cuda_timing import cuda_time_ms
    from splitserve.engine.attention.triton_decode import (
        FP8_TILE_KEYS,
        TILE_KEYS,
        choose_splits,
        paged_decode,
    )

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows: list[Row] = []
    for kv_dtype in kv_dtypes:
        fp8 = kv_dtype == "fp8"
        default_tile = FP8_TILE_KEYS if fp8 else TILE_KEYS
        for batch in batches:
            per_seq = -(-context // BLOCK_SIZE)
            shape = (batch * per_seq, BLOCK_SIZE, kv_heads, dim)
            k = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            scales = None
            if fp8:
                k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
                scales = torch.full((2, kv_heads), 0.5, device=dev)
            q = torch.randn(batch, heads, dim, device=dev, dtype=torch.bfloat16)
            tables = torch.arange(batch * per_seq, device=dev, dtype=torch.int32).view(batch, per_seq)
            lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
            base = choose_splits(batch, kv_heads, per_seq, sms)
            nbytes = 2 * batch * context * kv_heads * dim * k.element_size()
            shapes = sorted(
                {(t, w, min(64, per_seq, base * f)) for t in tiles for w in warps for f in split_factors}
            )
            for tile, num_warps, splits in shapes:
                call = partial(
                    paged_decode, q, k, v, tables, lens, dim**-0.5, splits, tile, scales, num_warps
                )
                try:
                    ms = cuda_time_ms(call, iters=10)
                except Exception as e:  # noqa: BLE001  (a shape this GPU cannot compile or run)
                    launch = f"tile {tile} warps {num_warps} splits {splits}"
                    log(f"{kv_dtype} B={batch} {launch}: {type(e).__name__}")
                    continue
                default = (tile, num_warps, splits) == (default_tile, 4, base)
                row = Row(kv_dtype, batch, context, tile, num_warps, splits, ms, nbytes / ms / 1e6, default)
                rows.append(row)
                log(_fmt(row))
    return rows


def _fmt(r: Row) -> str:
    mark = " (default)" if r.default else ""
    return (
        f"attention {r.kv_dtype:4} B={r.batch:<3} ctx={r.context} tile {r.tile_keys:<3} warps {r.num_warps} "
        f"splits {r.splits:<2}: "
        f"{r.ms * 1e3:8.1f} us {r.gbps:6.0f} GB/s{mark}"
    )


def summary(rows: list[Row]) -> list[str]:
    """Per (KV dtype, batch): the best shape against the default's."""
    lines = []
    for key in sorted({(r.kv_dtype, r.batch) for r in rows}):
        mine = [r for r in rows if (r.kv_dtype, r.batch) == key]
        best = min(mine, key=lambda r: r.ms)
        default = next((r for r in mine if r.default), None)
        now = f"default {default.ms * 1e3:.1f} us ({default.gbps:.0f} GB/s)" if default else "default not run"
        lines.append(
            f"best {key[0]} B={key[1]}: tile {best.tile_keys} warps {best.num_warps} splits {best.splits} "
            f"{best.ms * 1e3:.1f} us ({best.gbps:.0f} GB/s); {now}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kv-dtype", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--tiles", type=int, nargs="+", default=list(TILES), help="keys per tile")
    ap.add_argument("--warps", type=int, nargs="+", default=list(WARPS))
    ap.add_argument(
        "--split-factors", type=int, nargs="+", default=list(SPLIT_FACTORS), help="times choose_splits' pick"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention needs a CUDA device")
    rows = sweep(
        tuple(args.batch),
        args.context,
        tuple(args.kv_dtype),
        tiles=tuple(args.tiles),
        warps=tuple(args.warps),
        split_factors=tuple(args.split_factors),
    )
    for line in summary(rows):
        print(line)


if __name__ == "__main__":
    main()
