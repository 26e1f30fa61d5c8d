"""Portable attention on ``torch.nn.functional.scaled_dot_product_attention`` (CPU, GPU).

Decode: all decode sequences in one SDPA call. Each sequence's blocks are
gathered block-wise (one ``index_select`` per layer, over block ids, not token
slots); grouped-query attention folds the query heads that share a KV head into
the query-length axis (``[B, kv_heads, group, D]``), so no K/V is repeated.

Prefill: one call per sequence; a prompt with no cached prefix attends over its
fresh K/V with ``is_causal``; a chunk after a prefix gathers the prefix from the
cache and uses an explicit bottom-right-aligned causal mask. KV heads are
repeated for the query heads and inputs are 4-D (otherwise CPU SDPA drops to
its slow math path).

An FP8 cache's blocks are dequantized as they are gathered (``kv_scales``), and
a prompt with no cached prefix attends over its fresh K/V rounded as the cache
holds them (as vLLM, which reads them back from the cache): where a prompt's
chunks begin, or whether its prefix came from elsewhere, changes no result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.attention.base import AttentionBackend, SeqSpan
from splitserve.engine.kv_quant import as_bytes, dequantize, quantize


@dataclass
class _Prefill:
    q_start: int
    q_len: int
    ctx_len: int
    blocks: torch.Tensor | None  # None: no prefix, attend over the fresh K/V
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend


@dataclass
class SdpaMetadata:
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [num_decodes * max_blocks] block ids
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[_Prefill]


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    reads_fp8_kv = True  # the blocks it gathers are dequantized (engine.kv_quant)

    def prepare(self, spans: list[SeqSpan], num_decodes: int, block_size: int, device: torch.device):
        decode_blocks = decode_mask = None
        max_blocks = 0
        if num_decodes:
            decodes = spans[:num_decodes]
            max_blocks = max(-(-s.ctx_len // block_size) for s in decodes)
            table = [
                s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks]))
                for s in decodes
            ]
            decode_blocks = torch.tensor(table, dtype=torch.long, device=device).view(-1)
            lens = torch.tensor([s.ctx_len for s in decodes], device=device)
            positions = torch.arange(max_blocks * block_size, device=device)
            decode_mask = (positions[None, :] < lens[:, None]).view(num_decodes, 1, 1, -1)
        prefills = []
        for s in spans[num_decodes:]:
            if s.ctx_len == s.q_len:
                prefills.append(_Prefill(s.q_start, s.q_len, s.ctx_len, None, None))
                continue
            nb = -(-s.ctx_len // block_size)
            blocks = torch.tensor(s.block_table[:nb], dtype=torch.long, device=device)
            q_pos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=device)
            k_pos = torch.arange(s.ctx_len, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
            prefills.append(_Prefill(s.q_start, s.q_len, s.ctx_len, blocks, mask))
        return SdpaMetadata(num_decodes, decode_blocks, decode_mask, prefills)

    def forward(self, q, k, v, k_cache, v_cache, meta: SdpaMetadata, scale: float, kv_scales=None):
        num_heads, head_dim = q.shape[1], q.shape[2]

        def gather(cache: torch.Tensor, blocks: torch.Tensor, kv: int) -> torch.Tensor:
            if kv_scales is None:
                return cache.index_select(0, blocks)
            got = as_bytes(cache).index_select(0, blocks).view(cache.dtype)
            return dequantize(got, kv_scales[kv], q.dtype)

        kv_heads = k.shape[1]
        group = num_heads // kv_heads
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            qd = q[:nd].view(nd, kv_heads, group, head_dim)
            kd = gather(k_cache, meta.decode_blocks, 0).view(nd, -1, kv_heads, head_dim)
            vd = gather(v_cache, meta.decode_blocks, 1).view(nd, -1, kv_heads, head_dim)
            od = F.scaled_dot_product_attention(
                qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=meta.decode_mask, scale=scale
            )
            out[:nd] = od.reshape(nd, num_heads, head_dim)
        for p in meta.prefills:
            qs = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)
            if p.blocks is None:
                ks = k[p.q_start : p.q_start + p.q_len]
                vs = v[p.q_start : p.q_start + p.q_len]
                if kv_scales is not None:  # as the cache holds them, so chunking changes nothing
                    ks = dequantize(quantize(ks, kv_scales[0]), kv_scales[0], q.dtype)
                    vs = dequantize(quantize(vs, kv_scales[1]), kv_scales[1], q.dtype)
            else:
                ks = gather(k_cache, p.blocks, 0).view(-1, kv_heads, head_dim)[: p.ctx_len]
                vs = gather(v_cache, p.blocks, 1).view(-1, kv_heads, head_dim)[: p.ctx_len]
            # 4-D inputs with KV heads repeated: 3-D inputs or enable_gqa drop CPU SDPA
            # to its slow math path.
            ks = ks.transpose(0, 1).repeat_interleave(group, dim=0)[None]
            vs = vs.transpose(0, 1).repeat_interleave(group, dim=0)[None]
            if p.blocks is None:
                o = F.scaled_dot_product_attention(qs[None], ks, vs, is_causal=True, scale=scale)
            else:
                o = F.scaled_dot_product_attention(qs[None], ks, vs, attn_mask=p.mask, scale=scale)
            out[p.q_start : p.q_start + p.q_len] = o[0].transpose(0, 1)
        return out
