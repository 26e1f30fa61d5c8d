"""FP8 KV cache: e4m3 values with a float32 scale per layer, K or V, and KV head.

A cache with ``kv_cache_dtype: fp8`` stores ``round_e4m3(x / scale)`` and reads
back ``stored * scale``: half the bytes of a bf16 cache per token, so twice the
tokens in the same memory and half the bytes moved by every KV handoff.

The scales are static for the cache's life (``KVCache.scales``,
``[num_layers, 2, kv_heads]``), as vLLM's are: taken from the checkpoint
where it ships them (``self_attn.k_scale`` / ``v_scale``, one per layer,
used for every head), else computed by the engine at start from a
calibration prompt, per layer and KV head, as vLLM's ``calculate_kv_scales``
does per tensor: ``amax / 200`` for K and ``amax / 100`` for V (e4m3's
largest value is 448: the range left above the calibration's largest value
absorbs prompts that run larger; beyond it values saturate), rounded up to a
power of two. Powers of two make what crosses a handoff exact: two workers'
calibrations that differ in the last bits (another thread count, another TP
size) almost always land on the same power, and where they do not, rescaling
by a power of two only shifts exponents (exact, short of e4m3's range ends).

Each worker calibrates its own cache, so a prefill worker's scales and a
decode worker's differ slightly: the KV crosses a handoff as the source's FP8
bytes, verified by their checksums, and the source's scales travel in its
handshake (``CompatInfo.kv_scales``); the sink then rescales the pulled heads
into its own scales (``requantize``), a local pass over the request's blocks.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
K_RANGE, V_RANGE = 200.0, 100.0  # vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT
SCHEME = "per_layer_kv_head"  # KVLayout.kv_scales of an FP8 cache ("none" otherwise)
MIN_SCALE = 1e-8  # a head whose calibration saw only zeros still gets a usable scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as raw bytes (same shape: e4m3 is one byte), anything else as it is:
    torch has no float8 index_select, index_copy_ or collectives on the CPU, so FP8
    caches are indexed, copied and sent as bytes."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, heads, head_dim] as e4m3 with one ``scale`` per head (saturating)."""
    return (x.float() / scale[None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` [..., heads, head_dim] in e4m3 back to ``dtype`` with one ``scale`` per head."""
    return (q.to(torch.float32) * scale[:, None]).to(dtype)


def calibrated_scales(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[2, heads]: the K and V scales of one layer from its calibration tokens' K and V
    ([tokens, heads, head_dim] each), rounded up to powers of two."""
    k_amax = k.float().abs().amax(dim=(0, 2))
    v_amax = v.float().abs().amax(dim=(0, 2))
    scales = torch.stack([k_amax / K_RANGE, v_amax / V_RANGE]).clamp_(min=MIN_SCALE)
    return torch.exp2(torch.ceil(torch.log2(scales)))


def requantize(
    cache: torch.Tensor, blocks: torch.Tensor, heads: slice, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Rescale, in place, the FP8 values of KV heads ``heads`` of ``blocks`` in ``cache``
    ([layers, 2, blocks, block_size, heads, head_dim]) from scales ``src`` into ``dst``
    (each [layers, 2, len(heads)]). A no-op where the two are equal."""
    if torch.equal(src, dst):
        return
    ratio = (src / dst)[:, :, None, None, :, None]  # [layers, 2, 1, 1, heads, 1]
    raw = as_bytes(cache)[:, :, :, :, heads]
    part = raw.index_select(2, blocks).view(FP8)
    fixed = (part.float() * ratio).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    raw.index_copy_(2, blocks, as_bytes(fixed))


def requantize_ids(
    cache: torch.Tensor, layout, ids: list[int], window_from: int, heads: slice, src, dst
) -> None:
    """``requantize`` over the blocks a transfer named (its flat ``ids`` and
    ``window_from``, ``wire.kv_layout.KVLayout``): in a grouped layout each layer
    group's blocks at its rows with its layers' scales (row i of a group holds its
    i-th layer); otherwise every layer over every id."""
    if torch.equal(src, dst):
        return
    device = cache.device
    if not layout.grouped:
        requantize(cache, torch.tensor(ids, dtype=torch.long, device=device), heads, src, dst)
        return
    groups: dict[int, list[int]] = {}
    for layer in range(layout.num_layers):
        groups.setdefault(layout.group(layer), []).append(layer)
    for layers in groups.values():
        start, stop = layout.layer_span(layers[0], len(ids), window_from)
        if stop > start:
            blocks = torch.tensor(ids[start:stop], dtype=torch.long, device=device)
            requantize(cache[: len(layers)], blocks, heads, src[layers], dst[layers])
