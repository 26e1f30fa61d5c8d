"""Paged decode attention as a Triton kernel (flash-decoding): K/V are read in place
through each sequence's block table, only as far as its context length, and the
context is split across programs so a batch of one still fills the GPU.

    grid = (batch, kv_heads, splits)
    program (b, h, s): the query heads of KV head h (the GQA group) of sequence b,
                       over blocks [s * per_split, (s + 1) * per_split) of its table,
                       with an online softmax; writes partial (max, sum, acc)
    combine (torch):   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s

Every shape the kernel sees is fixed for a given batch size and table width, so
a decode step that uses it can be captured in a CUDA graph. With
``TRITON_INTERPRET=1`` Triton runs the kernel on CPU tensors (how the tests
check it against SDPA without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_partial(
    q_ptr,  # [B, H, D]
    k_ptr,  # [num_blocks, BLOCK, KVH, D]
    v_ptr,
    tables_ptr,  # [B, max_blocks] int32
    lens_ptr,  # [B] int32
    m_ptr,  # [B, H, S] float32
    l_ptr,  # [B, H, S] float32
    acc_ptr,  # [B, H, S, D] float32
    scale,
    blocks_per_split,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_tb,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    s = tl.arange(0, BLOCK)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    ctx = tl.load(lens_ptr + b)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(ctx, BLOCK))
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for i in range(first, last):
        block = tl.load(tables_ptr + b * stride_tb + i).to(tl.int64)
        pos = i * BLOCK + s
        s_ok = pos < ctx
        offs = block * stride_kb + s[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_mask = s_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BLOCK]
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    row = (b * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split  # index into [B, H, S]
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (entries past a sequence's length are ignored)
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V; returns [B, H, D]."""
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
        block_tables,
        context_lens,
        m,
        l_sum,
        acc,
        scale,
        per_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(triton.next_power_of_2(group), 1),
        HEAD_DIM=dim,
        D_PAD=triton.next_power_of_2(dim),
        BLOCK=block,
        SPLITS=num_splits,
    )
    # Splits past a sequence's end saw no keys: max -inf, weight 0.
    top = m.amax(dim=2, keepdim=True)
    weight = torch.exp(m - top)
    out = (acc * weight[..., None]).sum(dim=2) / (l_sum * weight).sum(dim=2)[..., None]
    return out.to(q.dtype)


def choose_splits(batch: int, kv_heads: int, max_blocks: int, num_sms: int) -> int:
    """Enough splits for about two programs per multiprocessor, at least one block each."""
    want = -(-2 * num_sms // max(1, batch * kv_heads))
    return max(1, min(want, max_blocks, 64))
