"""The paged KV cache tensor and its layout.

One tensor per engine::

    cache[layer, k_or_v, block, slot_in_block, kv_head, head_dim]

so one block of one layer's K (or V) is a contiguous run of
``block_size * num_kv_heads * head_dim`` elements: the unit a transfer backend
moves, and what it registers once as one memory region. ``KVLayout`` is the
plain-data description the transfer layer needs to check compatibility.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"

    @property
    def block_bytes(self) -> int:
        """Bytes in one block of one layer's K (or V): the unit a transfer moves."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize


class KVCache:
    """Owns the cache tensor; block ids come from the engine's ``BlockManager``."""

    def __init__(self, layout: KVLayout, device: torch.device):
        self.layout = layout
        self.tensor = torch.zeros(
            layout.num_layers,
            2,
            layout.num_blocks,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
            dtype=getattr(torch, layout.dtype),
            device=device,
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer ``i``, each [num_blocks, block_size, kv_heads, head_dim]."""
        return self.tensor[i, 0], self.tensor[i, 1]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of the given blocks: [num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        return self.tensor.index_select(2, idx)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``; ``data`` must have exactly that shape."""
        expected = (*self.tensor.shape[:2], len(block_ids), *self.tensor.shape[3:])
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        self.tensor.index_copy_(2, idx, data.to(device=self.tensor.device, dtype=self.tensor.dtype))
