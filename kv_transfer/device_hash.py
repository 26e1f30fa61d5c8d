"""A checksum of KV blocks computed where the KV lives: one Triton kernel over a layer's
blocks on the GPU, no byte copied to the host (``integrity.layer_checksum`` uses it
for a CUDA cache; a host cache keeps xxh3, faster there).

The function, ``kv64``: a layer's bytes as the stream a transfer moves them in (K of
every block in order, then V; an MLA cache's one plane) read as little-endian 32-bit
words ``w[0..n)``, and

    mix(w, i) = fmix64((w + 1) * M0 ^ (i + 1) * M1)        # 64-bit, wrapping
    kv64      = fmix64(sum_i mix(w[i], i) ^ n * M2)         # the sum wrapping too

with ``fmix64`` MurmurHash3's 64-bit finalizer. Each word is mixed with its position,
so a changed word, two words, blocks or planes swapped, or bytes shifted change it
(not a cryptographic hash: a guard against bytes that went wrong, as xxh3 is here).
The sum makes it a kernel's natural shape: each program mixes one tile of one block
and stores its partial sum; the partials add up in any order to the same value.

``reference`` is the same function in numpy on host memory: the specification the
kernel is tested against (on the CPU, through Triton's interpreter) and what a host
can compute for bytes a device hashed.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

M0 = 0x9E3779B97F4A7C15
M1 = 0xC2B2AE3D27D4EB4F
M2 = 0x165667B19E3779F9
F1 = 0xFF51AFD7ED558CCD  # fmix64's multipliers
F2 = 0xC4CEB9FE1A85EC53
MASK = (1 << 64) - 1
TILE = 1024  # words a program mixes


def _fmix(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, elementwise (uint64, wrapping)."""
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(F1)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(F2)
    return x ^ (x >> np.uint64(33))


def _finish(total: int, num_words: int) -> int:
    """kv64 from the sum of the words' mixes (mod 2**64) and the number of words."""
    with np.errstate(over="ignore"):
        return int(_fmix(np.array([(total ^ (num_words * M2)) & MASK], dtype=np.uint64))[0])


def reference(data: bytes | np.ndarray) -> int:
    """``kv64`` of ``data`` (a whole number of 32-bit words), in numpy."""
    w = np.frombuffer(data if isinstance(data, bytes) else data.tobytes(), dtype="<u4").astype(np.uint64)
    i = np.arange(1, len(w) + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = _fmix(((w + np.uint64(1)) * np.uint64(M0)) ^ (i * np.uint64(M1)))
        total = int(mixed.sum(dtype=np.uint64))
    return _finish(total, len(w))


@triton.jit
def _fmix64(x):
    x ^= x >> 33
    x *= 0xFF51AFD7ED558CCD
    x ^= x >> 33
    x *= 0xC4CEB9FE1A85EC53
    return x ^ (x >> 33)


@triton.jit
def _kv64_tiles(
    words_ptr,  # the cache as int32 words
    segments_ptr,  # [S] int64: the word offset of each segment (a block of one plane) in the cache
    partials_ptr,  # [S, tiles] int64: each program's sum
    seg_words,  # words per segment
    tiles,
    TILE: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    at = tile * TILE + tl.arange(0, TILE)
    ok = at < seg_words
    base = tl.load(segments_ptr + seg)
    w = tl.load(words_ptr + base + at, mask=ok, other=0).to(tl.uint32).to(tl.uint64)
    i = (seg.to(tl.uint64) * seg_words + at.to(tl.uint64) + 1).to(tl.uint64)
    mixed = _fmix64(((w + 1) * 0x9E3779B97F4A7C15) ^ (i * 0xC2B2AE3D27D4EB4F))
    mixed = tl.where(ok, mixed, 0)
    tl.store(partials_ptr + seg * tiles + tile, tl.sum(mixed, axis=0).to(tl.int64, bitcast=True))


def layer_kv64(planes: torch.Tensor, block_ids: list[int] | tuple[int, ...]) -> int:
    """``kv64`` of one layer's ``planes`` [k/v, block, ...] (contiguous from the block
    dimension on; any device) over ``block_ids``: K of each block in order, then V.
    One launch; only the 8-byte result reaches the host."""
    pending = PendingKV64()
    pending.add(planes, block_ids)
    return pending.values()[0]


class PendingKV64:
    """``kv64`` of several layers, launched as each is added and read back together:
    ``add`` queues one kernel on the current stream and returns at once (no
    synchronisation: a pull hashes a layer while the next one moves); ``values`` waits
    once and gives each added layer's ``kv64``, in order. One owner (not thread-safe)."""

    def __init__(self) -> None:
        self._sums: list[torch.Tensor] = []  # per layer: the sum of its words' mixes, on the device
        self._words: list[int] = []  # per layer: how many words
        self._segments: dict[tuple, torch.Tensor] = {}  # the word offsets of a set of blocks, on the device

    def add(self, planes: torch.Tensor, block_ids: list[int] | tuple[int, ...]) -> None:
        """Queue ``kv64`` of ``planes`` [k/v, block, ...] (as ``layer_kv64``) over ``block_ids``."""
        words = planes.view(torch.int32) if planes.element_size() == 4 else _as_words(planes)
        per_block = words[0, 0].numel()
        key = (str(planes.device), tuple(block_ids), planes.shape[0], words.stride(0), words.stride(1))
        segments = self._segments.get(key)
        if segments is None:  # a pull's layers mostly share one list of blocks: one upload, three launches
            ids = torch.tensor(key[1], dtype=torch.int64)
            at = torch.arange(planes.shape[0], dtype=torch.int64)[:, None] * key[3] + ids[None, :] * key[4]
            segments = self._segments[key] = at.reshape(-1).to(planes.device)
        tiles = triton.cdiv(per_block, TILE)
        partials = torch.empty(segments.numel(), tiles, dtype=torch.int64, device=planes.device)
        _kv64_tiles[(segments.numel(), tiles)](words, segments, partials, per_block, tiles, TILE=TILE)
        self._sums.append(partials.sum())  # int64 sums wrap as the uint64 sum does
        self._words.append(segments.numel() * per_block)

    def values(self) -> list[int]:
        """Each added layer's ``kv64``, in the order added (one wait for the device)."""
        if not self._sums:
            return []
        totals = torch.stack(self._sums).tolist()
        return [_finish(total & MASK, n) for total, n in zip(totals, self._words, strict=True)]


def _as_words(planes: torch.Tensor) -> torch.Tensor:
    """``planes`` [k/v, block, ...] as int32 words per block (the bytes of each block
    viewed whole: a block of bf16 or e4m3 values is a whole number of words)."""
    flat = planes.reshape(planes.shape[0], planes.shape[1], -1)
    return flat.view(torch.uint8).view(torch.int32)
