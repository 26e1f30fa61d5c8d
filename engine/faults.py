"""A handoff fault (``wire.faults``) applied to the KV an engine holds for one request:
its bytes changed, or right bytes put in the wrong place. Only a harness arms them
(``Engine.inject_fault``)."""

from __future__ import annotations

import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_quant import requantize
from splitserve.wire.faults import HandoffFault


def inject(fault: HandoffFault, kv_cache: KVCache, block_ids: list[int], rope_dim: int | None) -> None:
    """Apply ``fault`` to ``block_ids`` (a request's blocks, in its block table's order) in
    ``kv_cache``. Raises ``ValueError`` where this cache cannot have the fault (one block,
    one KV head, one plane, not an FP8 cache, not MLA), changing nothing. The caller makes
    sure no other request reads these blocks (``Engine.inject_fault``)."""
    if fault is HandoffFault.SOURCE_BYTES_CHANGED:  # one byte of the first block's first layer
        raw = kv_cache.tensor.view(torch.uint8)
        raw[0, 0, block_ids[0], 0, 0, 0] ^= 0x5A
        return
    if fault is HandoffFault.FP8_SCALES_SWAPPED:
        _read_with_swapped_scales(kv_cache, block_ids)
        return
    data = kv_cache.read_blocks(block_ids)
    kv_cache.write_blocks(block_ids, _misplaced(fault, data, rope_dim))


def _misplaced(fault: HandoffFault, data: torch.Tensor, rope_dim: int | None) -> torch.Tensor:
    """``data`` ([layers, planes, blocks, block_size, kv_heads, head_dim]) with ``fault``."""
    if fault in (
        HandoffFault.SOURCE_BLOCK_REUSED,  # another request's prefill wrote the first block
        HandoffFault.PREFIX_BLOCK_OTHER_TOKENS,  # the first block holds the KV of other positions
    ):
        _need(data.shape[2] > 1, "two blocks")
        out = data.clone()
        out[:, :, 0] = data[:, :, -1]
        return out
    if fault is HandoffFault.BLOCK_TABLE_PERMUTED:
        _need(data.shape[2] > 1, "two blocks")
        order = [data.shape[2] - 1, *range(1, data.shape[2] - 1), 0]
        return data[:, :, order]
    if fault is HandoffFault.LAYERS_SWAPPED:
        _need(data.shape[0] > 1, "two layers")
        return data[[1, 0, *range(2, data.shape[0])]]
    if fault is HandoffFault.KV_HEADS_SWAPPED:
        _need(data.shape[-2] > 1, "two KV heads")
        return data[..., [1, 0, *range(2, data.shape[-2])], :]
    if fault is HandoffFault.K_AND_V_SWAPPED:
        _need(data.shape[1] == 2, "K and V planes")
        return data[:, [1, 0]]
    if fault is HandoffFault.MLA_PARTS_SWAPPED:
        _need(rope_dim is not None, "an MLA cache")
        return torch.roll(data, rope_dim, dims=-1)  # the rope part first, the latent after it
    raise ValueError(f"{fault.name} is not a fault of the KV's placement")


def _read_with_swapped_scales(kv_cache: KVCache, block_ids: list[int]) -> None:
    """The request's FP8 KV of layers 0 and 1 rescaled so that the engine reads each as
    if it had been quantized with the other layer's scales."""
    _need(kv_cache.scales is not None and kv_cache.scales.shape[0] > 1, "an FP8 cache of two layers")
    _need(not kv_cache.layout.grouped, "a cache without layer groups")
    _need(not torch.equal(kv_cache.scales[0], kv_cache.scales[1]), "layers 0 and 1 of different FP8 scales")
    true = kv_cache.scales
    swapped = true.clone()
    swapped[[0, 1]] = true[[1, 0]]
    blocks = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.tensor.device)
    heads = slice(0, true.shape[-1])
    requantize(kv_cache.tensor, blocks, heads, swapped, true)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"this fault needs {what}")
