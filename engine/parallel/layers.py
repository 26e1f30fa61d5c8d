"""Megatron-style tensor parallelism: the layers a model is built from, each
holding only this rank's shard from the start (the loader reads each rank's
slice of every checkpoint tensor into them; no rank ever holds the whole model)::

    qkv_proj      column-parallel: this rank's query heads and KV heads (q, k, v rows)
    o_proj        row-parallel:    this rank's query-head columns, then all-reduce
    gate_up_proj  column-parallel: this rank's slice of gate rows and of up rows
    down_proj     row-parallel:    the matching columns, then all-reduce
    embed_tokens  vocab-parallel:  rows [r*V/tp, (r+1)*V/tp); other ids give 0, then all-reduce
    lm_head       vocab-parallel:  the same rows; logits all-gathered along the vocabulary

Column-parallel layers are plain ``nn.Linear`` of the shard's size. Norms and
rotary tables are replicated. Query heads and the MLP width must split evenly
over the ranks. KV heads split evenly too, or, when there are fewer KV heads
than ranks, are replicated (``kv_head_range``: each rank keeps the one KV head
its query heads attend to, as vLLM does; the KV handoff reads each head from one
of its replicas, ``splitserve.kv_transfer.tp_mapping``). Every layer here also
runs at TP=1, where its collectives are the identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.parallel.group import TPGroup
from splitserve.wire.kv_layout import kv_head_range as layout_head_range


def kv_head_range(num_kv_heads: int, group: TPGroup) -> tuple[int, int]:
    """The model's KV heads this rank holds (``splitserve.wire.kv_layout.kv_head_range``)."""
    return layout_head_range(num_kv_heads, group.size, group.rank)


class RowParallelLinear(nn.Module):
    """A linear over this rank's slice of the input features, summed over ranks.
    ``linear`` holds the shard (quantization and CPU packing replace it); the bias
    (if any) is added once, after the sum."""

    def __init__(self, in_per_rank: int, out_features: int, bias: bool, group: TPGroup):
        super().__init__()
        self.linear = nn.Linear(in_per_rank, out_features, bias=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


def vocab_rows(vocab_size: int, group: TPGroup) -> tuple[int, int, int]:
    """(start, stop, rows): this rank's vocabulary rows [start, stop) and the rows its
    shard holds (``ceil(V / tp)``; the last rank's extra rows are zeros)."""
    per = -(-vocab_size // group.size)
    start = group.rank * per
    return start, min(start + per, vocab_size), per


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, group: TPGroup):
        super().__init__()
        self.start, _, self.rows = vocab_rows(vocab_size, group)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden), requires_grad=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(out)


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered into the full vocabulary."""

    def __init__(self, vocab_size: int, hidden: int, group: TPGroup):
        super().__init__()
        self.linear = nn.Linear(hidden, vocab_rows(vocab_size, group)[2], bias=False)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_last_dim(self.linear(x))
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
