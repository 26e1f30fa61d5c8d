"""How large an engine's KV cache is, and what it holds, as vLLM sizes its own.

The budget (``kv_budget_bytes``):

- ``kv_cache_memory_mib`` when set: that many MiB, on any device;
- else on CUDA ``kv_cache_memory_fraction`` of the device memory still free once
  the weights are loaded (the rest is left to activations and CUDA graphs);
- else (CPU) ``DEFAULT_CPU_KV_CACHE_MIB``.

``num_kv_blocks`` overrides the budget with an exact count. A TP group takes the
smallest count any rank could hold, so every rank has the same block ids.

The context (``size_kv_cache``): a ``max_model_len`` that was set must fit in
the cache (else ``ValueError``, naming the numbers and both ways out); one left
to the model's ``max_position_embeddings`` is lowered to what the cache holds,
with a warning. ``KVCapacity.describe`` is the line logged at start, and
``splitserve status`` shows the same figures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from splitserve.wire.config import EngineConfig

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MIB = 1024


@dataclass(frozen=True)
class KVCapacity:
    """An engine's KV cache, and the context and concurrency it allows."""

    num_blocks: int  # blocks requests can use (a CUDA graph's scratch block excluded)
    block_size: int
    bytes_per_token: int  # this rank's K and V of one token, all layers
    max_model_len: int  # prompt + output tokens of one request at most

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens the cache holds at once (vLLM's figure)."""
        return self.num_tokens / self.max_model_len

    def describe(self) -> str:
        gib = self.num_tokens * self.bytes_per_token / 2**30
        return (
            f"KV cache {self.num_tokens:,} tokens ({gib:.2f} GiB, "
            f"{self.bytes_per_token / 1024:.1f} KiB per token); max context {self.max_model_len:,} "
            f"tokens; {self.max_concurrency:.2f}x concurrency at that length"
        )


def kv_budget_bytes(config: EngineConfig, device_type: str, free_device_bytes: int | None) -> int:
    """Bytes the KV cache may take (see the module docstring). ``free_device_bytes``:
    device memory free now, after the weights (CUDA; None elsewhere)."""
    if config.kv_cache_memory_mib is not None:
        return config.kv_cache_memory_mib * 2**20
    if device_type == "cuda" and free_device_bytes is not None:
        return int(free_device_bytes * config.kv_cache_memory_fraction)
    return DEFAULT_CPU_KV_CACHE_MIB * 2**20


def blocks_for(config: EngineConfig, budget_bytes: int, bytes_per_token: int) -> int:
    """Blocks the budget holds (or ``num_kv_blocks``, when set); at least one."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    return max(1, budget_bytes // (bytes_per_token * config.block_size))


def model_context(config: EngineConfig, model_max_len: int) -> int:
    """The longest request the model itself allows: ``max_model_len`` when set (checked
    before any weight is loaded: ``ValueError`` if longer than the model's), else the model's."""
    if config.max_model_len is None:
        return model_max_len
    if config.max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} is longer than the model's context "
            f"({model_max_len} tokens, its max_position_embeddings)"
        )
    return config.max_model_len


def size_kv_cache(
    config: EngineConfig, usable_blocks: int, bytes_per_token: int, context: int, window_blocks: int = 0
) -> KVCapacity:
    """The capacity of ``usable_blocks`` and the context it allows, given ``context``
    (``model_context``'s answer; see the module docstring), of which one request's
    sliding layer groups may hold ``window_blocks`` (``KVLayout.grouped``). Raises
    ``ValueError`` when a configured ``max_model_len`` does not fit."""
    tokens = max(0, usable_blocks - window_blocks) * config.block_size
    max_len = context
    if context > tokens:
        if config.max_model_len is not None:
            need = context * bytes_per_token / 2**30
            raise ValueError(
                f"max_model_len {context} needs {need:.2f} GiB of KV cache for one request, "
                f"but the cache holds {tokens} tokens ({usable_blocks} blocks of {config.block_size}); "
                f"give the KV cache more memory (kv_cache_memory_mib, or kv_cache_memory_fraction on a GPU) "
                f"or lower max_model_len to at most {tokens}"
            )
        max_len = tokens
        log.warning(
            "the model's context is %d tokens but the KV cache holds %d: requests are limited "
            "to %d tokens (set max_model_len, or give the KV cache more memory)",
            context,
            tokens,
            max_len,
        )
    if max_len < 2:
        raise ValueError(f"the KV cache holds {tokens} token(s); a request needs at least 2")
    return KVCapacity(usable_blocks, config.block_size, bytes_per_token, max_len)
