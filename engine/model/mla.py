"""DeepSeek's multi-head latent attention (MLA), in the absorbed form, over a paged
cache of latents.

Per token the cache holds one row per layer, shared by every head::

    row = [ c_kv (kv_lora_rank, RMS-normed) | k_pe (qk_rope_head_dim, rotated) ]

and nothing else: no per-head K or V. ``kv_b_proj`` [heads * (nope + v), kv_lora_rank]
expands a latent into each head's key (``W_UK``, the first ``nope`` rows of a head's
block) and value (``W_UV``, the last ``v``). Attention never expands the cache;
``W_UK`` is absorbed into the query and ``W_UV`` applied after::

    q_nope [T, h, nope] @ W_UK[h] -> q_lat [T, h, kv_lora_rank]
    score(t, s) = (q_lat[t] . c_kv[s] + q_pe[t] . k_pe[s]) * scale       (MQA over rows)
    o_lat[t] = sum_s softmax(score)[t, s] c_kv[s]  ->  o_lat @ W_UV[h]^T -> [T, h, v] -> o_proj

which equals the reference's expanded form (``q . k = q_nope . (W_UK c) + q_pe . k_pe``).
The same form serves prefill and decode (``engine.attention.mla``).

DeepSeek-V3.2's sparse attention (``Indexer``): per token the row also holds the
indexer's key ``k_idx`` (LayerNorm(wk x), its first ``qk_rope`` dimensions rotated
half-split, not interleaved); a query's index score of an earlier token is
``sum_h w[h] * relu(q_idx[h] . k_idx * d^-0.5)`` (``w = weights_proj(x) * H^-0.5``,
``q_idx = wq_b(q bottleneck)``), and it attends only to its ``index_topk`` best
tokens (all of them while it has fewer).

Rotary: DeepSeek-V3's rotary pairs are interleaved ((x0, x1), (x2, x3), ...); they
are de-interleaved before the usual half-split rotation, which is the same rotation
(the cache holds the rotated key in the half-split order; any consistent order gives
the same dot products). Under tensor parallelism a rank holds its heads' rows of
``q_b_proj`` / ``kv_b_proj`` and columns of ``o_proj``; the latent (``kv_a_proj``)
is computed whole on every rank, so every rank's cache holds the same rows.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.attention.mla import IndexQuery
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.llama import RMSNorm, StepContext
from splitserve.engine.model.rope import apply_rotary, yarn_mscale
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.layers import RowParallelLinear


class LatentProjection(nn.Module):
    """``kv_b_proj``'s weight, this rank's heads' rows: read by the absorbed attention,
    never applied as a linear (so quantization and CPU packing leave it alone)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)


def _softmax_mscale(rope: dict) -> float:
    """The softmax scale's YaRN correction the reference applies (``mscale_all_dim``)."""
    m_all = rope.get("mscale_all_dim", 0)
    if rope.get("rope_type", "default") == "default" or not m_all:
        return 1.0
    return yarn_mscale(rope.get("factor", 1.0), m_all)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1, x2, x3, ...)] -> [..., (x0, x2, ..., x1, x3, ...)]."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer (see the module docstring), whole on every rank
    (every rank must choose the same tokens)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.mla
        self.n_heads, self.head_dim, self.topk = m.index_n_heads, m.index_head_dim, m.index_topk
        self.wq_b = nn.Linear(m.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def forward(self, x, q_resid, cos, sin) -> tuple[torch.Tensor, IndexQuery]:
        """(each token's indexer key [T, d], to go into its cache row; its query)."""
        t = x.shape[0]
        q = apply_rotary(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_norm(self.wk(x))[:, None, :], cos, sin)[:, 0]
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return k, IndexQuery(q, weights, self.head_dim**-0.5, self.topk)


class MLAttention(nn.Module):
    """This rank's heads of one MLA layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        m = cfg.mla
        self.mla = m
        h0, h1 = tp.shard_range(cfg.num_heads)
        self.num_heads = h1 - h0
        qk = m.qk_head_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.num_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, m.score_dim, bias=False)
        self.indexer = Indexer(cfg) if m.index_topk else None
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps)
        per_head = m.qk_nope_head_dim + m.v_head_dim
        self.kv_b_proj = LatentProjection(self.num_heads * per_head, m.kv_lora_rank)
        self.o_proj = RowParallelLinear(self.num_heads * m.v_head_dim, cfg.hidden_size, False, tp)
        self.scale = qk**-0.5 * _softmax_mscale(cfg.rope) ** 2

    def forward(self, x, cos, sin, cache, _unused, ctx: StepContext, kv_scales=None) -> torch.Tensor:
        """Attention output [T, hidden]; this step's latent rows written to ``cache``
        ([num_blocks, block_size, 1, latent_dim]) at ``ctx.slot_mapping``."""
        m, t = self.mla, x.shape[0]
        if m.q_lora_rank:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        else:
            q = self.q_proj(x)
        q = q.view(t, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe = apply_rotary(q_pe, cos, sin)
        k_pe = apply_rotary(k_pe[:, None, :], cos, sin)
        parts, index = [self.kv_a_layernorm(c_kv.contiguous()), k_pe[:, 0]], None
        if self.indexer is not None:
            k_idx, index = self.indexer(x, q_resid, cos, sin)
            parts.append(k_idx.to(c_kv.dtype))
        cache.view(-1, m.latent_dim).index_copy_(0, ctx.slot_mapping, torch.cat(parts, dim=-1))
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        q_rows = torch.cat((q_lat, q_pe), dim=-1)  # [T, heads, latent_dim]: a query of the rows
        extra = {} if index is None else {"index": index}
        o_lat = ctx.backend.forward(q_rows, None, None, cache, None, ctx.attn_meta, self.scale, **extra)
        o = torch.einsum("thc,hvc->thv", o_lat, w_uv)
        return self.o_proj(o.reshape(t, self.num_heads * m.v_head_dim))
