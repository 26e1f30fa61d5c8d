"""``KVLayout``: the plain-data shape of a paged KV cache (no torch), shared by
the engine, the transfer layer and every process that checks compatibility.
``splitserve.engine.kv_cache`` describes the tensor it lays out."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads, over all ranks."""
        return self.num_kv_heads * self.tp_size

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """The model's KV heads this cache holds: [start, stop)."""
        return self.tp_rank * self.num_kv_heads, (self.tp_rank + 1) * self.num_kv_heads

    @property
    def block_bytes(self) -> int:
        """Bytes in one block of one layer's K (or V): the unit a transfer moves."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]
