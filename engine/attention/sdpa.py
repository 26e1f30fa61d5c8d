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

A sliding-window layer (``window``) also masks the keys older than its window
(the masks built once per step and window, shared by the layers: ``masks``).
Attention sinks (``sinks``) enter as one more key: the query gains a dimension
holding ``sink / scale``, every key a zero there, and the sink key is that
dimension's unit vector with a zero value, so its logit is the head's sink and it
adds nothing to the output (exact, at the price of an explicit mask and copies of
q, k and v: a sink layer's attention costs about 2.5x a plain one's here).

Soft-capped logits (``softcap``: Gemma 2) have no hook in SDPA: such a layer
computes its logits, caps them (``cap * tanh(logit / cap)``), masks them and takes
the softmax itself, in float32, as transformers' eager attention does.

An FP8 cache's blocks are dequantized as they are gathered (``kv_scales``), and
a prompt with no cached prefix attends over its fresh K/V rounded as the cache
holds them (as vLLM, which reads them back from the cache): where a prompt's
chunks begin, or whether its prefix came from elsewhere, changes no result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    device: torch.device | None = None
    # per sliding window: the decode mask and each prefill's explicit mask (``masks``)
    windowed: dict[int, tuple[torch.Tensor | None, list[torch.Tensor]]] = field(default_factory=dict)

    def masks(self, window: int | None) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """The decode mask and each prefill's mask (True: attend; None: plain causal over
        fresh K/V) for layers of ``window`` (None: full attention); the first layer of
        a window builds them, the others share them."""
        if window is None:
            return self.decode_mask, [p.mask for p in self.prefills]
        if window not in self.windowed:
            decode = self.decode_mask
            if decode is not None:
                lens = decode.sum(dim=-1, keepdim=True)  # each row's context length
                positions = torch.arange(decode.shape[-1], device=decode.device)
                decode = decode & (positions >= lens - window)
            prefills = [_causal_mask(p.q_len, p.ctx_len, window, self.device) for p in self.prefills]
            self.windowed[window] = (decode, prefills)
        return self.windowed[window]


def _causal_mask(q_len: int, ctx_len: int, window: int | None = None, device=None) -> torch.Tensor:
    """[q_len, ctx_len] bool: the last ``q_len`` of ``ctx_len`` positions each attend to
    every key at or before their own (bottom-right aligned), within ``window`` if set."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def with_sink(q, k, v, mask, sinks, scale: float):
    """q [..., Hk, Q, D], k and v [..., Hk, S, D], mask [..., Q, S] bool (broadcast over
    heads) and ``sinks`` broadcastable to q's [..., Hk, Q]: the same attention with one
    more key in front whose logit is the sink and whose value is zero (module docstring)."""
    shape = q.shape[:-1]
    q = torch.cat([q, (sinks.to(q.dtype) / scale).expand(shape)[..., None]], dim=-1)
    k = torch.cat([k, k.new_zeros(*k.shape[:-1], 1)], dim=-1)
    unit = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    unit[..., -1] = 1
    k = torch.cat([unit, k], dim=-2)
    v = torch.cat([v.new_zeros(*v.shape[:-2], 1, v.shape[-1]), v], dim=-2)
    mask = torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)
    return q, k, v, mask


def _attend(q, k, v, mask, scale: float, softcap: float | None):
    """SDPA of q over k and v (``mask``: True = attend; None: causal); with ``softcap``,
    the same attention with each logit soft-capped first (module docstring)."""
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask is None:
        mask = _causal_mask(q.shape[-2], k.shape[-2], device=q.device)
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    logits = (softcap * torch.tanh(logits / softcap)).masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1).to(v.dtype), v)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    reads_fp8_kv = True  # the blocks it gathers are dequantized (engine.kv_quant)
    windows_and_sinks = True

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
            mask = _causal_mask(s.q_len, s.ctx_len, device=device)
            prefills.append(_Prefill(s.q_start, s.q_len, s.ctx_len, blocks, mask))
        return SdpaMetadata(num_decodes, decode_blocks, decode_mask, prefills, device)

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: SdpaMetadata,
        scale: float,
        kv_scales=None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ):
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
        decode_mask, prefill_masks = meta.masks(window)
        if nd:
            qd = q[:nd].view(nd, kv_heads, group, head_dim)
            kd = gather(k_cache, meta.decode_blocks, 0).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
            vd = gather(v_cache, meta.decode_blocks, 1).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
            if sinks is not None:
                per_head = sinks.view(kv_heads, group)
                qd, kd, vd, decode_mask = with_sink(qd, kd, vd, decode_mask, per_head, scale)
            od = _attend(qd, kd, vd, decode_mask, scale, softcap)
            out[:nd] = od.reshape(nd, num_heads, head_dim)
        for p, mask in zip(meta.prefills, prefill_masks):
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
            qs = qs[None]
            if sinks is not None:
                if mask is None:
                    mask = _causal_mask(p.q_len, p.ctx_len, device=q.device)
                qs, ks, vs, mask = with_sink(qs, ks, vs, mask, sinks[:, None], scale)
            o = _attend(qs, ks, vs, mask, scale, softcap)
            out[p.q_start : p.q_start + p.q_len] = o[0].transpose(0, 1)
        return out
