"""Paged decode attention as a Triton kernel (flash-decoding): K/V are read in place
through each sequence's block table, only as far as its context length, and the
context is split across programs so a batch of one still fills the GPU.

    grid = (batch, kv_heads, splits)
    program (b, h, s): the query heads of KV head h (the GQA group) of sequence b,
                       over blocks [s * per_split, (s + 1) * per_split) of its table,
                       with an online softmax; writes partial (max, sum, acc)
    combine (torch):   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s

An FP8 cache (``engine.kv_quant``: e4m3 values, one float32 scale per KV head)
is read as it is stored, one byte per value: the program widens each tile in
registers and applies its head's scales to the scores (K) and to the weighted
sum (V), so FP8 KV moves half the bytes of bf16 KV and gathers nothing.
The scales are powers of two, so this is exact against dequantizing first.

Sliding windows, attention sinks and soft-capped logits (gpt-oss, Gemma 2 and 3):
with ``window`` a program reads only the blocks from the one holding the window's
first key (a split wholly before it sees no key and weighs nothing), and masks the
keys before that key; ``softcap`` caps each scaled logit (``cap * tanh(x / cap)``)
before the softmax; ``sinks`` (one logit per query head) enter in the combine:
one more term ``exp(sink - M)`` in the denominator, none in the sum (a key with a
zero value), exact.

Every shape the kernel sees is fixed for a given batch size and table width, so
a decode step that uses it can be captured in a CUDA graph (an FP8 cache's
scales are a fixed tensor too). With
``TRITON_INTERPRET=1`` Triton runs the kernel on CPU tensors (how the tests
check it against SDPA without a GPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_partial(
    q_ptr,  # [B, H, D]
    k_ptr,  # [num_blocks, BLOCK, KVH, D]
    v_ptr,
    ks_ptr,  # [KVH] float32: an FP8 cache's K scales (KV_FP8), else unused
    vs_ptr,  # [KVH] float32: its V scales
    tables_ptr,  # [B, max_blocks] int32
    lens_ptr,  # [B] int32
    m_ptr,  # [B, H, S] float32
    l_ptr,  # [B, H, S] float32
    acc_ptr,  # [B, H, S, D] float32
    scale,
    blocks_per_split,
    window,  # keys a query reaches back (sliding layers), 0: every earlier key
    softcap,  # logits become softcap * tanh(logit / softcap); 0: not capped
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_tb,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # >= 16: tl.dot's smallest M
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,  # KV blocks per iteration: TILE_BLOCKS * BLOCK keys at a time
    SPLITS: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds e4m3 values with per-head scales
    FP32_DOT: tl.constexpr,  # dots in full float32 (float32 caches; the interpreter, whose bf16 dot is wrong)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, TILE_BLOCKS * BLOCK)  # key slots of one tile
    t_block = t // BLOCK
    t_slot = t % BLOCK
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    ctx = tl.load(lens_ptr + b)
    if KV_FP8:  # K's scale folds into the score scale; V's multiplies the sum at the end
        scale = scale * tl.load(ks_ptr + kvh)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(ctx, BLOCK))
    oldest = 0  # the first key position the query reaches
    if window > 0:
        oldest = tl.maximum(ctx - window, 0)
        first = tl.maximum(first, oldest // BLOCK)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for i in range(first, last, TILE_BLOCKS):
        idx = i + t_block
        in_split = idx < last
        block = tl.load(tables_ptr + b * stride_tb + idx, mask=in_split, other=0).to(tl.int64)
        pos = idx * BLOCK + t_slot
        s_ok = in_split & (pos < ctx) & (pos >= oldest)
        offs = block[:, None] * stride_kb + t_slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_mask = s_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)  # [TILE, D]
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        if KV_FP8 and not FP32_DOT:  # e4m3 widens exactly to the query's dtype
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if FP32_DOT:
            k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, TILE], float32
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        if softcap > 0:  # tanh(x) = 1 - 2 / (exp(2x) + 1), finite for every x
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(vs_ptr + kvh)
    row = (b * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split  # index into [B, H, S]
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


# Triton reads TRITON_INTERPRET once, at import; so does this module.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Keys per tile the kernel aims for (a multiple of the block size): wide enough for
# many loads in flight per program, small enough to stay in registers. An FP8 cache
# takes twice the keys, so that a tile moves as many bytes as a bf16 one.
TILE_KEYS = 64
FP8_TILE_KEYS = 128


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (entries past a sequence's length are ignored)
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    num_splits: int,
    tile_keys: int | None = None,
    kv_scales: torch.Tensor | None = None,  # [2, KVH] float32 with an FP8 (e4m3) cache
    num_warps: int = 4,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [H]: one more logit per head, with a zero value
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V; returns [B, H, D].
    An FP8 cache comes with its K and V scales per KV head (``engine.kv_quant``).
    ``window``, ``sinks`` and ``softcap`` as ``AttentionBackend.forward`` takes them
    (the module docstring).
    ``tile_keys`` (default ``TILE_KEYS``, ``FP8_TILE_KEYS`` for FP8) and ``num_warps``
    are the launch's shape (``bench.decode_attention`` sweeps them)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (kv_scales is not None):
        raise ValueError("an FP8 KV cache needs its kv_scales, and only an FP8 cache takes them")
    if tile_keys is None:
        tile_keys = FP8_TILE_KEYS if fp8 else TILE_KEYS
    batch, heads, dim = q.shape
    num_blocks_max = block_tables.shape[1]
    kv_heads, block = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    per_split = -(-num_blocks_max // num_splits)
    m = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    _paged_decode_partial[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        kv_scales[0] if fp8 else context_lens,  # (a placeholder pointer, never read)
        kv_scales[1] if fp8 else context_lens,
        block_tables,
        context_lens,
        m,
        l_sum,
        acc,
        scale,
        per_split,
        window or 0,
        softcap or 0.0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(triton.next_power_of_2(group), 16),
        HEAD_DIM=dim,
        D_PAD=max(triton.next_power_of_2(dim), 16),
        BLOCK=block,
        TILE_BLOCKS=max(1, tile_keys // block),
        SPLITS=num_splits,
        KV_FP8=fp8,
        FP32_DOT=q.dtype == torch.float32 or _INTERPRETED,
        num_warps=num_warps,
    )
    out = torch.empty_like(q)
    _combine_splits[(batch * heads,)](
        m,
        l_sum,
        acc,
        out,
        sinks.float().contiguous() if sinks is not None else m,  # (a placeholder, never read)
        heads,
        HAS_SINKS=sinks is not None,
        SPLITS=num_splits,
        S_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=dim,
        D_PAD=triton.next_power_of_2(dim),
    )
    return out


@triton.jit
def _combine_splits(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    sinks_ptr,  # [H] float32 (HAS_SINKS)
    heads,
    HAS_SINKS: tl.constexpr,
    SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """One (sequence, head): out = sum_s w_s acc_s / (sum_s w_s l_s [+ exp(sink - M)]),
    w_s = exp(m_s - M), M the largest of the m_s [and the sink]. Splits past a
    sequence's end (or before its window) saw no keys: m = -inf, so their weight is 0."""
    row = tl.program_id(0)
    s = tl.arange(0, S_PAD)
    s_ok = s < SPLITS
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    m = tl.load(m_ptr + row * SPLITS + s, mask=s_ok, other=float("-inf"))
    top = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + row % heads)
        top = tl.maximum(top, sink)
    weight = tl.where(s_ok, tl.exp(m - top), 0.0)
    l_sum = tl.sum(tl.load(l_ptr + row * SPLITS + s, mask=s_ok, other=0.0) * weight, axis=0)
    if HAS_SINKS:
        l_sum += tl.exp(sink - top)
    acc = tl.load(
        acc_ptr + (row * SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / l_sum
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def choose_splits(batch: int, kv_heads: int, max_blocks: int, num_sms: int) -> int:
    """Enough splits for about two programs per multiprocessor, at least one block each."""
    want = -(-2 * num_sms // max(1, batch * kv_heads))
    return max(1, min(want, max_blocks, 64))
