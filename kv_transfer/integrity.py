"""Checksums of KV blocks and the contiguous runs transfers are built from.

The KV cache tensor is ``[layer, k/v, block, slot, kv_head, head_dim]``
(``splitserve.engine.kv_cache``; one plane, not two, for an MLA latent cache),
contiguous, so for each (layer, k/v) a run
of consecutive block ids is one contiguous byte range. A request's blocks are
hashed and moved as such runs, in the order (layer, k/v, run). The checksum
is one xxh3-64 per layer, so a sink can verify layer by layer while later
layers are still moving (and a source can hash each layer as prefill writes it).
"""

from __future__ import annotations

import torch
import xxhash

from splitserve.wire.kv import CompatInfo


def check_cache(cache: torch.Tensor, compat: CompatInfo) -> None:
    """Raise ``ValueError`` unless ``cache`` is contiguous and laid out as ``compat`` says."""
    lay = compat.layout
    expected = (lay.num_layers, lay.planes, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
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


def layer_checksum(cache: torch.Tensor, layer: int, block_ids: list[int] | tuple[int, ...]) -> int:
    """xxh3-64 over one layer's bytes of the blocks: K of every block in order, then V
    (an MLA cache: its latent rows).

    A CPU tensor is hashed in place (~25-30 GB/s on one core here; the hash
    releases the GIL, so another thread can move bytes meanwhile); from a GPU
    cache only those blocks are copied to the host first (a device-side hash is
    future work)."""
    block_runs = runs(block_ids)
    planes = cache[layer]  # [k/v, block, slot, head, dim]
    if cache.device.type != "cpu":
        idx = torch.tensor(list(block_ids), device=cache.device)
        planes, block_runs = planes.index_select(1, idx).cpu(), [(0, len(block_ids))]
    raw = planes.reshape(planes.shape[0], planes.shape[1], -1).view(torch.uint8)  # last dim contiguous
    h = xxhash.xxh3_64()
    for kv in range(raw.shape[0]):
        for first, n in block_runs:
            h.update(raw[kv, first : first + n].numpy())
    return h.intdigest()


def layer_checksums(cache: torch.Tensor, block_ids: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """``layer_checksum`` of every layer, in layer order."""
    return tuple(layer_checksum(cache, layer, block_ids) for layer in range(cache.shape[0]))
