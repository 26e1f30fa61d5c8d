"""Attention over a paged cache of MLA latents (``engine.model.mla``), in torch.

Every head attends to the same rows (multi-query attention): the score of query
``q [h, D]`` and row ``r [D]`` is ``q . r``, and the value is the row's first
``latent`` columns (``c_kv``). Decode spans are batched (rows gathered through
the block tables into ``[n, widest, D]``, masked past each context length);
each prefill span reads its rows and applies the causal mask, its queries taken
``QUERY_CHUNK`` at a time so the scores of a long prompt stay bounded. Softmax in
float32. A correct reference for any device; the GPU wants a fused kernel.

A row may be wider than a query (DeepSeek-V3.2: the indexer's key at its end);
queries score the first ``score_dim`` columns. With an ``IndexQuery`` each query
attends only to the ``topk`` earlier rows of best index score
(``engine.model.mla``), the scores computed from the rows' indexer keys here, in
float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention.base import AttentionBackend, SeqSpan, decode_tables

QUERY_CHUNK = 256


@dataclass(frozen=True)
class IndexQuery:
    """DeepSeek-V3.2's indexer query of each token: ``q`` [T, H, d], ``weights`` [T, H]
    float32, the scale of ``q . k``, and how many tokens each query keeps."""

    q: torch.Tensor
    weights: torch.Tensor
    scale: float
    topk: int

    def keep(self, rows: slice, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[n, S] True where query ``rows`` (n of them) attends: among the keys it may
        see (``visible`` [n, S]) the ``topk`` of best index score. ``keys`` [n or 1, S, d]."""
        q = self.q[rows].float()
        keys = keys.float().expand(q.shape[0], -1, -1)
        scores = torch.relu(torch.einsum("nhd,nsd->nhs", q, keys) * self.scale)
        index = torch.einsum("nh,nhs->ns", self.weights[rows], scores).masked_fill(~visible, float("-inf"))
        best = index.topk(min(self.topk, index.shape[1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(1, best, True) & visible


@dataclass
class MlaMetadata:
    prefills: list[SeqSpan]
    block_size: int
    num_decodes: int
    block_tables: torch.Tensor | None  # [num_decodes, widest table]
    context_lens: torch.Tensor | None  # [num_decodes]


class MlaBackend(AttentionBackend):
    """``forward(q, None, None, cache, None, meta, scale)``: q [T, h, D] against the
    first D columns of the rows of ``cache`` [num_blocks, block_size, 1, row]; returns
    [T, h, latent]. With ``index`` (an ``IndexQuery``; the rows' last columns, as wide
    as its queries, its keys) each query attends to its top-k rows only."""

    name = "mla"

    def __init__(self, latent: int):
        self.latent = latent

    def prepare(self, spans: list[SeqSpan], num_decodes: int, block_size: int, device: torch.device):
        tables = lens = None
        if num_decodes:
            tables, lens = decode_tables(spans[:num_decodes], device)
        return MlaMetadata(spans[num_decodes:], block_size, num_decodes, tables, lens)

    def forward(self, q, k, v, k_cache, v_cache, meta: MlaMetadata, scale: float, kv_scales=None, index=None):
        if kv_scales is not None:
            raise ValueError("an MLA cache is not quantized")
        rows = k_cache.view(k_cache.shape[0], k_cache.shape[1], -1)  # [blocks, block_size, row]
        d = q.shape[-1]
        keys = slice(rows.shape[-1] - (0 if index is None else index.q.shape[-1]), None)  # the indexer's
        out = q.new_empty(q.shape[0], q.shape[1], self.latent)
        nd = meta.num_decodes
        if nd:
            ctx = rows[meta.block_tables].flatten(1, 2)  # [n, widest * block_size, row]
            scores = torch.einsum("nhd,nsd->nhs", q[:nd].float(), ctx[..., :d].float()) * scale
            visible = torch.arange(ctx.shape[1], device=q.device)[None, :] < meta.context_lens[:, None]
            if index is not None:
                visible = index.keep(slice(0, nd), ctx[..., keys], visible)
            probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)
            out[:nd] = torch.einsum("nhs,nsc->nhc", probs, ctx[..., : self.latent].float()).to(q.dtype)
        for span in meta.prefills:
            table = torch.tensor(span.block_table, dtype=torch.long, device=q.device)
            ctx = rows[table].flatten(0, 1)[: span.ctx_len].float()  # [ctx_len, row]
            first = span.ctx_len - span.q_len  # the position of the span's first query
            for j in range(0, span.q_len, QUERY_CHUNK):
                n = min(QUERY_CHUNK, span.q_len - j)
                qs = q[span.q_start + j : span.q_start + j + n].float()  # [n, h, D]
                scores = torch.einsum("nhd,sd->nhs", qs, ctx[:, :d]) * scale
                pos = torch.arange(first + j, first + j + n, device=q.device)
                visible = torch.arange(span.ctx_len, device=q.device)[None, :] <= pos[:, None]
                if index is not None:
                    at = slice(span.q_start + j, span.q_start + j + n)
                    visible = index.keep(at, ctx[None, :, keys], visible)
                probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)
                out[span.q_start + j : span.q_start + j + n] = torch.einsum(
                    "nhs,sc->nhc", probs, ctx[:, : self.latent]
                ).to(q.dtype)
        return out
