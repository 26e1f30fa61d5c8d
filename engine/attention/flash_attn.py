"""Attention through the ``flash_attn`` package (CUDA only), selected automatically
when it imports on a CUDA device.

Prefill: ``flash_attn_varlen_func`` over all prefill sequences at once, keys
gathered from the paged cache per sequence. Decode: ``flash_attn_with_kvcache``
with a block table (flash-attn requires the paged block size to be a multiple of
256; with smaller blocks decode falls back to the same varlen call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention.base import AttentionBackend, SeqSpan

PAGED_BLOCK_MULTIPLE = 256


@dataclass
class FlashMetadata:
    num_tokens: int
    num_decodes: int
    paged_decode: bool
    block_table: torch.Tensor | None  # [num_decodes, max_blocks] int32, paged decode only
    cache_seqlens: torch.Tensor | None  # [num_decodes] int32
    varlen_q_start: int  # first packed token handled by the varlen call
    gather_slots: torch.Tensor | None  # [total_k] slot ids of keys for the varlen call
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    max_q: int
    max_k: int


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self) -> None:
        import flash_attn  # noqa: F401  (fail at selection time, not mid-step)

    def prepare(self, spans: list[SeqSpan], num_decodes: int, block_size: int, device: torch.device):
        paged = num_decodes > 0 and block_size % PAGED_BLOCK_MULTIPLE == 0
        block_table = cache_seqlens = None
        if paged:
            decodes = spans[:num_decodes]
            width = max(len(s.block_table) for s in decodes)
            rows = [s.block_table + [0] * (width - len(s.block_table)) for s in decodes]
            block_table = torch.tensor(rows, dtype=torch.int32, device=device)
            cache_seqlens = torch.tensor([s.ctx_len for s in decodes], dtype=torch.int32, device=device)
        varlen = spans[num_decodes:] if paged else spans
        slots: list[int] = []
        cu_q, cu_k = [0], [0]
        for s in varlen:
            slots.extend(
                s.block_table[p // block_size] * block_size + p % block_size for p in range(s.ctx_len)
            )
            cu_q.append(cu_q[-1] + s.q_len)
            cu_k.append(cu_k[-1] + s.ctx_len)

        def t(x):
            return torch.tensor(x, dtype=torch.int32, device=device)

        return FlashMetadata(
            num_tokens=sum(s.q_len for s in spans),
            num_decodes=num_decodes,
            paged_decode=paged,
            block_table=block_table,
            cache_seqlens=cache_seqlens,
            varlen_q_start=num_decodes if paged else 0,
            gather_slots=torch.tensor(slots, dtype=torch.long, device=device) if varlen else None,
            cu_seqlens_q=t(cu_q) if varlen else None,
            cu_seqlens_k=t(cu_k) if varlen else None,
            max_q=max((s.q_len for s in varlen), default=0),
            max_k=max((s.ctx_len for s in varlen), default=0),
        )

    def forward(self, q, k, v, k_cache, v_cache, meta: FlashMetadata, scale: float, kv_scales=None):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        out = torch.empty_like(q)
        if meta.paged_decode:
            nd = meta.num_decodes
            o = flash_attn_with_kvcache(
                q[:nd].unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.cache_seqlens,
                block_table=meta.block_table,
                softmax_scale=scale,
                causal=True,
            )
            out[:nd] = o.squeeze(1)
        if meta.gather_slots is not None:
            kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
            ks = k_cache.view(-1, kv_heads, head_dim).index_select(0, meta.gather_slots)
            vs = v_cache.view(-1, kv_heads, head_dim).index_select(0, meta.gather_slots)
            s = meta.varlen_q_start
            out[s:] = flash_attn_varlen_func(
                q[s:],
                ks,
                vs,
                meta.cu_seqlens_q,
                meta.cu_seqlens_k,
                meta.max_q,
                meta.max_k,
                softmax_scale=scale,
                causal=True,
            )
        return out
