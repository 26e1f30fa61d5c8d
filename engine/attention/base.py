"""The attention backend interface.

The model runner describes each step's batch as ``SeqSpan``s over the packed
token dimension, decode spans (one query token each) first::

    packed tokens   [d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 p1]
    spans           q_len 1 1 1   q_len 5          q_len 3
                    ctx_len = tokens in cache after this step (prefix + new)

Before ``forward`` the layer has already written this step's K/V into the paged
cache (``slot_mapping``), so a backend reads every key from the cache (or, for a
prompt with no cached prefix, straight from the fresh K/V). ``prepare`` runs once
per step and its result is shared by all layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SeqSpan:
    q_start: int  # offset of the sequence's first new token in the packed batch
    q_len: int  # new tokens this step
    ctx_len: int  # tokens with KV in the cache after this step (includes the new ones)
    block_table: list[int]


def decode_tables(
    decodes: list[SeqSpan], device: torch.device, dtype: torch.dtype = torch.long
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [n, widest table] (short rows padded with block 0, which a kernel
    never reads past a sequence's length) and context lengths [n] of decode spans."""
    width = max(len(s.block_table) for s in decodes)
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in decodes]
    tables = torch.tensor(rows, dtype=dtype, device=device)
    return tables, torch.tensor([s.ctx_len for s in decodes], dtype=dtype, device=device)


class AttentionBackend(ABC):
    name: str
    reads_fp8_kv: bool = False  # takes an FP8 cache with its scales
    # takes ``window``, ``sinks`` and ``softcap`` (sliding-window layers, attention sinks:
    # gpt-oss; soft-capped logits: Gemma 2); a model with any runs only on a backend
    # that does (``engine.build``)
    windows_and_sinks: bool = False

    @abstractmethod
    def prepare(self, spans: list[SeqSpan], num_decodes: int, block_size: int, device: torch.device) -> Any:
        """Build per-step metadata (tensors shared by every layer)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], already written to the cache
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: Any,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of every query over its sequence's keys; returns [T, H, D].
        ``kv_scales`` ([2, kv_heads]) comes with an FP8 cache (``engine.kv_quant``), which
        only backends that set ``reads_fp8_kv`` take. Backends that set
        ``windows_and_sinks`` also take the keywords ``window`` (int or None: a query at
        position p attends to keys in (p - window, p]), ``sinks`` ([H] or None: one
        more logit per head in the softmax, whose value is zero: gpt-oss's sinks) and
        ``softcap`` (float or None: each logit becomes ``cap * tanh(logit / cap)``)."""
