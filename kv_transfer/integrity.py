"""Checksums of KV blocks and the contiguous runs transfers are built from.

The KV cache tensor is ``[layer, k/v, block, slot, kv_head, head_dim]``
(``splitserve.engine.kv_cache``; one plane, not two, for an MLA latent cache),
contiguous, so for each (layer, k/v) a run
of consecutive block ids is one contiguous byte range. A request's blocks are
hashed and moved as such runs, in the order (layer, k/v, run). The checksum
is one 64-bit value per layer (xxh3-64 in host memory, ``device_hash``'s kv64 on
a GPU, computed there), so a sink can verify layer by layer while later layers
are still moving (and a source can hash each layer as prefill writes it).
A sliding layer of a transfer with ``window_from`` moves and hashes only the
blocks from there on, and a grouped layout's sliding layers their own group's
blocks (``KVLayout.layer_blocks``, ``layer_runs``; ``pack``): the layer's row of
the tensor (``KVLayout.row``) holds them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import xxhash

from splitserve.wire.kv import CompatInfo, checksum_kind
from splitserve.wire.kv_layout import KVLayout

if TYPE_CHECKING:
    from splitserve.kv_transfer.device_hash import PendingKV64  # imports Triton


def check_cache(cache: torch.Tensor, compat: CompatInfo) -> None:
    """Raise ``ValueError`` unless ``cache`` is contiguous and laid out as ``compat`` says."""
    lay = compat.layout
    expected = lay.cache_shape
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


def layer_checksum(
    cache: torch.Tensor, layer: int, block_ids: list[int] | tuple[int, ...], layout: KVLayout | None = None
) -> int:
    """The checksum of one layer's bytes of the blocks: K of every block in order, then V
    (an MLA cache: its latent rows). ``layout``: where the layer's row is (a grouped
    layout's, ``KVLayout.row``); without it, row ``layer``. Which function
    (``wire.kv.checksum_kind``) depends on where the cache lives:

    - host memory: xxh3-64, in place (~25-30 GB/s on one core here; the hash releases
      the GIL, so another thread can move bytes meanwhile);
    - a GPU: ``device_hash``'s kv64, one kernel over the blocks where they are (only its
      8-byte result reaches the host)."""
    planes = cache[layer if layout is None else layout.row(layer)]  # [k/v, block, slot, head, dim]
    if checksum_kind(cache.device.type) == "kv64":
        from splitserve.kv_transfer.device_hash import layer_kv64  # Triton: where there is a GPU

        return layer_kv64(planes, block_ids)
    block_runs = runs(block_ids)
    if cache.device.type != "cpu":
        idx = torch.tensor(list(block_ids), device=cache.device)
        planes, block_runs = planes.index_select(1, idx).cpu(), [(0, len(block_ids))]
    raw = planes.reshape(planes.shape[0], planes.shape[1], -1).view(torch.uint8)  # last dim contiguous
    h = xxhash.xxh3_64()
    for kv in range(raw.shape[0]):
        for first, n in block_runs:
            h.update(raw[kv, first : first + n].numpy())
    return h.intdigest()


def device_checksums(cache: torch.Tensor) -> PendingKV64 | None:
    """A ``device_hash.PendingKV64`` for a cache whose checksums a kernel computes where
    it lives (``checksum_kind`` "kv64": a GPU's), else None (the host hashes it)."""
    if checksum_kind(cache.device.type) != "kv64":
        return None
    from splitserve.kv_transfer.device_hash import PendingKV64  # Triton: where there is a GPU

    return PendingKV64()


def layer_checksums(
    cache: torch.Tensor,
    block_ids: list[int] | tuple[int, ...],
    layout: KVLayout | None = None,
    window_from: int = 0,
) -> tuple[int, ...]:
    """``layer_checksum`` of every layer, in layer order; with ``layout``, a sliding
    layer's over its blocks from ``window_from`` on (``KVLayout.layer_blocks``)."""
    pending = device_checksums(cache)
    if pending is not None:  # every layer queued, one wait for the GPU
        for layer in range(cache.shape[0] if layout is None else layout.num_layers):
            row = layer if layout is None else layout.row(layer)
            pending.add(
                cache[row],
                block_ids if layout is None else layout.layer_blocks(layer, block_ids, window_from),
            )
        return tuple(pending.values())
    if layout is None:
        return tuple(layer_checksum(cache, layer, block_ids) for layer in range(cache.shape[0]))
    return tuple(
        layer_checksum(cache, layer, layout.layer_blocks(layer, block_ids, window_from), layout)
        for layer in range(layout.num_layers)
    )


def pack(
    cache: torch.Tensor,
    layout: KVLayout,
    block_ids: list[int] | tuple[int, ...],
    window_from: int,
    layers: range,
) -> torch.Tensor:
    """The bytes of ``layers`` of the blocks a transfer moves, one flat host tensor in the
    order (run of layers, layer, k/v, block: ``KVLayout.layer_runs``): what a two-sided
    backend sends."""
    parts = []
    for lo, hi, start, stop in layout.layer_runs(layers, len(block_ids), window_from):
        idx = torch.tensor(list(block_ids[start:stop]), dtype=torch.long, device=cache.device)
        row = layout.row(lo)
        parts.append(cache[row : row + hi - lo].index_select(2, idx).reshape(-1))
    return torch.cat(parts).cpu() if len(parts) > 1 else parts[0].cpu().contiguous()


def unpack(
    cache: torch.Tensor,
    layout: KVLayout,
    block_ids: list[int] | tuple[int, ...],
    window_from: int,
    layers: range,
    data: torch.Tensor,
) -> None:
    """Inverse of ``pack``: scatter ``data`` into ``block_ids`` of ``layers``. ``ValueError``
    unless it holds exactly those bytes."""
    groups = layout.layer_runs(layers, len(block_ids), window_from)
    per_block = cache[0, :, 0].numel()  # one layer's K/V (or latent) of one block
    need = sum((hi - lo) * (stop - start) * per_block for lo, hi, start, stop in groups)
    if data.numel() != need:
        raise ValueError(f"{data.numel()} KV elements arrived for {need}")
    at = 0
    for lo, hi, start, stop in groups:
        dst = block_ids[start:stop]
        n = (hi - lo) * len(dst) * per_block
        shape = (hi - lo, cache.shape[1], len(dst), *cache.shape[3:])
        idx = torch.tensor(list(dst), dtype=torch.long, device=cache.device)
        row = layout.row(lo)
        cache[row : row + hi - lo].index_copy_(2, idx, data[at : at + n].view(shape).to(cache.device))
        at += n
