"""Checksums of KV blocks and the contiguous runs transfers are built from.

The KV cache tensor is ``[layer, k/v, block, slot, kv_head, head_dim]``
(``splitserve.engine.kv_cache``), contiguous, so for each (layer, k/v) a run
of consecutive block ids is one contiguous byte range. A request's blocks are
hashed and moved as such runs, in the order (layer, k/v, run).
"""

from __future__ import annotations

import torch
import xxhash

from splitserve.kv_transfer.contract import CompatInfo


def check_cache(cache: torch.Tensor, compat: CompatInfo) -> None:
    """Raise ``ValueError`` unless ``cache`` is contiguous and laid out as ``compat`` says."""
    lay = compat.layout
    expected = (lay.num_layers, 2, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
    if tuple(cache.shape) != expected or str(cache.dtype) != f"torch.{lay.dtype}":
        raise ValueError(f"KV cache {tuple(cache.shape)} {cache.dtype} does not match layout {lay}")
    if not cache.is_contiguous():
        raise ValueError("the KV cache tensor must be contiguous")


def runs(block_ids: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids as (first id, length): [3,4,5,9] -> [(3,3),(9,1)]."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def paired_runs(
    src: list[int] | tuple[int, ...], dst: list[int] | tuple[int, ...]
) -> list[tuple[int, int, int]]:
    """Runs contiguous on both sides, as (src first, dst first, length)."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def checksum(cache: torch.Tensor, block_ids: list[int] | tuple[int, ...]) -> int:
    """xxh3-64 over the blocks' bytes in (layer, k/v, block) order.

    A CPU tensor is hashed in place (~30 GB/s on one core here); a GPU cache is
    copied to host first (a device-side hash is future work)."""
    if cache.device.type != "cpu":
        cache = cache.cpu()
    flat = cache.view(cache.shape[0] * 2, cache.shape[2], -1)
    raw = flat.view(torch.uint8)  # dtype-agnostic bytes; last dim is contiguous
    h = xxhash.xxh3_64()
    block_runs = runs(block_ids)
    for lk in range(raw.shape[0]):
        for first, n in block_runs:
            h.update(raw[lk, first : first + n].numpy())
    return h.intdigest()
