"""Megatron-style tensor parallelism for ``LlamaModel``, applied by slicing a loaded
model in place (every rank loads the same weights, then keeps its shard)::

    qkv_proj      column-parallel: this rank's query heads and KV heads (q, k, v rows)
    o_proj        row-parallel:    this rank's query-head columns, then all-reduce
    gate_up_proj  column-parallel: this rank's slice of gate rows and of up rows
    down_proj     row-parallel:    the matching columns, then all-reduce
    embed_tokens  vocab-parallel:  rows [r*V/tp, (r+1)*V/tp); other ids give 0, then all-reduce
    lm_head       vocab-parallel:  the same rows; logits all-gathered along the vocabulary

Norms and rotary tables are replicated. Each rank's KV cache holds only its KV
heads (``num_kv_heads / tp``), so KV heads must split evenly over the ranks (and
query heads and the MLP width too); a model that does not is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.llama import MLP, Attention, LlamaModel
from splitserve.engine.parallel.group import TPGroup


def check_tp_compatible(cfg: ModelConfig, tp_size: int) -> None:
    """Raise ``ValueError`` naming the dimension that does not split over ``tp_size`` ranks."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    for what, n in (
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("MLP intermediate size", cfg.intermediate_size),
    ):
        if n % tp_size:
            raise ValueError(
                f"tensor parallelism of {tp_size} needs the model's {what} ({n}) to divide by {tp_size}"
            )


class RowParallelLinear(nn.Module):
    """A linear over this rank's slice of the input features, summed over ranks.
    The bias (if any) is added once, after the sum."""

    def __init__(self, linear: nn.Linear, bias: torch.Tensor | None, group: TPGroup):
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V/tp (padded), hidden]
        self.start, self.rows = start, weight.shape[0]
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(out)


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered into the full vocabulary."""

    def __init__(self, linear: nn.Linear, vocab_size: int, group: TPGroup):
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last_dim(self.linear(x))[..., : self.vocab_size]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


def _rows(t: torch.Tensor | None, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
    return None if t is None else torch.cat([t[a:b] for a, b in ranges])


@torch.no_grad()
def shard_model(model: LlamaModel, group: TPGroup) -> None:
    """Keep this rank's shard of every parallel layer (in place). Call after loading
    the weights and before quantizing or packing linears. A no-op for TP=1."""
    if group.size == 1:
        return
    cfg = model.config
    check_tp_compatible(cfg, group.size)
    d = cfg.head_dim
    h0, h1 = group.shard_range(cfg.num_heads)
    k0, k1 = group.shard_range(cfg.num_kv_heads)
    i0, i1 = group.shard_range(cfg.intermediate_size)
    q_rows = (h0 * d, h1 * d)
    k_rows = (cfg.q_size + k0 * d, cfg.q_size + k1 * d)
    v_rows = (cfg.q_size + cfg.kv_size + k0 * d, cfg.q_size + cfg.kv_size + k1 * d)
    for layer in model.layers:
        attn: Attention = layer.self_attn
        qkv = attn.qkv_proj
        qkv_ranges = [q_rows, k_rows, v_rows]
        attn.qkv_proj = _linear(_rows(qkv.weight, qkv_ranges), _rows(qkv.bias, qkv_ranges))
        o = attn.o_proj
        attn.o_proj = RowParallelLinear(_linear(o.weight[:, q_rows[0] : q_rows[1]], None), o.bias, group)
        attn.num_heads, attn.num_kv_heads = h1 - h0, k1 - k0
        attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
        mlp: MLP = layer.mlp
        gu = mlp.gate_up_proj.weight
        inter = cfg.intermediate_size
        mlp.gate_up_proj = _linear(_rows(gu, [(i0, i1), (inter + i0, inter + i1)]), None)
        mlp.down_proj = RowParallelLinear(_linear(mlp.down_proj.weight[:, i0:i1], None), None, group)
        mlp.inter = i1 - i0
    _shard_vocab(model, group)


def _shard_vocab(model: LlamaModel, group: TPGroup) -> None:
    cfg = model.config
    per = -(-cfg.vocab_size // group.size)  # rows per rank; the last rank is zero-padded
    start = group.rank * per

    def shard(full: torch.Tensor) -> torch.Tensor:
        part = full[start : min(start + per, cfg.vocab_size)]
        pad = per - part.shape[0]
        return torch.cat([part, part.new_zeros(pad, part.shape[1])]) if pad else part.clone()

    embed = shard(model.embed_tokens.weight)
    head = embed if cfg.tie_word_embeddings else shard(model.lm_head.weight)
    model.embed_tokens = VocabParallelEmbedding(embed, start, group)
    lm_head = _linear(head, None)
    if cfg.tie_word_embeddings:
        lm_head.weight = model.embed_tokens.weight
    model.lm_head = VocabParallelLMHead(lm_head, cfg.vocab_size, group)
