"""The host-memory KV tier: prefix blocks evicted from the engine's cache, kept by
content hash in host memory, and copied back when a prompt asks for them again.

Where it sits (``BlockManager`` calls it; it never calls the block manager)::

    engine cache (device)             host tier (this module)
    ---------------------             -----------------------
    a hashed free block is  ── save ──►  slot <- the block's bytes, all layers,
      reused (evicted)                      checksum (xxh3-64 of the slot)
                                            LRU: a full tier drops its oldest
    a waiting prompt's next ◄─ load ───  checksum checked, bytes copied into the
      full block is missing                 fresh block; a mismatch drops the
      from the cache                        entry (the caller recomputes it)

A slot holds one block of every layer and plane, ``[layers, planes, block_size,
kv_heads, head_dim]``, in the cache's dtype (an FP8 cache's blocks keep its scales,
which are fixed for the engine's life). An entry is named by the block's hash and
its tokens (both checked on a hit, as the cache itself does). On CUDA the store is
pinned host memory; each save and load is one copy of one block.

Single-rank engines only (``tp_size`` and ``ep_size`` 1): under TP or EP every rank
would need its own tier and the saves would have to reach the ranks before any
write into the evicted block (an import pulls into blocks off the step channel).

Counters (``counters()``, a ``TierCounters``) are cumulative since the engine started. Not thread-safe:
the engine's thread (the block manager's) calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import xxhash

from splitserve.engine.kv_cache import KVCache
from splitserve.wire.outputs import TierCounters


@dataclass
class _Entry:
    slot: int
    tokens: tuple[int, ...]
    checksum: int


class HostKVTier:
    """``capacity`` blocks of host memory for ``cache``'s evicted prefix blocks."""

    def __init__(self, cache: KVCache, capacity: int):
        if capacity < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {capacity}")
        lay = cache.layout
        shape = (capacity, lay.num_layers, lay.planes, lay.block_size, lay.num_kv_heads, lay.head_dim)
        pin = cache.tensor.device.type == "cuda"
        self._store = torch.empty(shape, dtype=cache.tensor.dtype, pin_memory=pin)
        self._cache = cache
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # hash -> entry, oldest use first
        self._free = list(range(capacity - 1, -1, -1))
        self.capacity = capacity
        self.saved = self.reloaded = self.dropped = self.corrupt = 0  # blocks, since start

    @classmethod
    def of_size(cls, cache: KVCache, mib: int) -> HostKVTier:
        """A tier of as many of ``cache``'s blocks as fit in ``mib`` MiB of host memory;
        ``ValueError`` when not even one does."""
        per_block = cache.tensor[:, :, 0].numel() * cache.tensor.element_size()
        if mib * 2**20 < per_block:
            raise ValueError(
                f"host_kv_tier_mib={mib} holds no KV block of this model (one block is {per_block:,} bytes)"
            )
        return cls(cache, (mib * 2**20) // per_block)

    def holds(self, h: int, tokens: tuple[int, ...]) -> bool:
        """Whether the tier has the block named ``h`` holding ``tokens``; a hit is marked
        recently used (a prompt about to load it should not lose it first)."""
        entry = self._entries.get(h)
        if entry is None or entry.tokens != tokens:
            return False
        self._entries.move_to_end(h)
        return True

    def __contains__(self, h: int) -> bool:
        return h in self._entries

    def hashes(self) -> list[int]:
        return list(self._entries)

    def save(self, h: int, tokens: tuple[int, ...], block: int) -> list[int]:
        """Copy cache block ``block`` (named ``h``, holding ``tokens``) into the tier before
        the cache reuses it. Returns the hashes the tier dropped to make room (oldest
        first), which nobody holds any more unless the cache does."""
        entry = self._entries.get(h)
        if entry is not None and entry.tokens == tokens:
            self._entries.move_to_end(h)  # the tier has these bytes already
            return []
        dropped = []
        if entry is not None:
            self._drop(h)
        if not self._free:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            dropped.append(oldest)
            self.dropped += 1
        slot = self._free.pop()
        self._store[slot].copy_(self._cache.tensor[:, :, block])
        self._entries[h] = _Entry(slot, tokens, self._checksum(slot))
        self.saved += 1
        return dropped

    def load(self, h: int, block: int) -> bool:
        """Copy the tier's block ``h`` into cache block ``block``, after checking its
        checksum. False when it is not held or its bytes changed since they were saved
        (then the entry is dropped and counted corrupt: the caller computes the block)."""
        entry = self._entries.get(h)
        if entry is None:
            return False
        if self._checksum(entry.slot) != entry.checksum:
            self._drop(h)
            self.corrupt += 1
            return False
        self._cache.tensor[:, :, block].copy_(self._store[entry.slot])
        self._entries.move_to_end(h)
        self.reloaded += 1
        return True

    def _drop(self, h: int) -> None:
        self._free.append(self._entries.pop(h).slot)

    def _checksum(self, slot: int) -> int:
        return xxhash.xxh3_64_intdigest(self._store[slot].reshape(-1).view(torch.uint8).numpy())

    def slot_bytes(self, h: int) -> torch.Tensor:
        """The bytes the tier holds for ``h`` (a view: writing to it changes the entry)."""
        return self._store[self._entries[h].slot].reshape(-1).view(torch.uint8)

    def counters(self) -> TierCounters:
        return TierCounters(
            self.capacity, len(self._entries), self.saved, self.reloaded, self.dropped, self.corrupt
        )
