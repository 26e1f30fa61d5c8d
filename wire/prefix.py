"""Prefix-cache identity that other processes can follow: a named block hash, and a
log of the hashes a block manager holds. Plain data, no torch (a router imports it).

**The hash.** A full block of ``block_size`` tokens is named by
``blake2b(parent's hash || its tokens)``, 8 bytes, as an int. It is the same in every
process and every Python (unlike ``hash()``), so a router can hash a prompt and ask
which worker holds which of its blocks::

    prompt      t0 .. t15 | t16 .. t31 | t32 t33
    hashes      [  h0     |   h1      ]             h1 = H(h0, t16..t31); no hash
                                                    for the partial last block

**The log.** Each block manager numbers, from 0, every change to its set of
registered hashes (``stored`` when a computed block is registered, ``removed``
when an evicted block's hash is dropped). A reader keeps a ``PrefixCursor``
(``epoch``: this block manager's identity, so a restarted worker is noticed;
``seq``: events seen) and asks ``since(cursor)``; it gets the events it missed,
or the whole set when it is new, from another epoch, or so far behind that the
log no longer holds its events::

    events   0:+h0  1:+h1  2:-h0  3:+h7 ...      (bounded; the oldest drop off)
    since(epoch, 2) -> PrefixUpdate(seq=4, events=[-h0, +h7])
    since(other epoch, ..) -> PrefixUpdate(seq=4, snapshot=True, events=[+h1, +h7])
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

_NO_PARENT = b"\x00" * 8


def block_hash(parent: int | None, tokens: tuple[int, ...] | list[int]) -> int:
    """The name of a full block of ``tokens`` after the block named ``parent`` (None for
    a prompt's first block): 64 bits of BLAKE2b, the same in every process."""
    h = hashlib.blake2b(_NO_PARENT if parent is None else parent.to_bytes(8, "little"), digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def prefix_root(adapter_digest: str | None) -> int | None:
    """The parent of a prompt's first block under the LoRA adapter whose weights have
    ``adapter_digest`` (``engine.lora.LoRAAdapter.digest``; None: the base model's, no
    parent): every chain of an adapter's blocks starts from it, so the prefix cache never
    gives one adapter's KV to another (nor to one loaded again under the same name with
    other weights), or to the base."""
    if adapter_digest is None:
        return None
    root = hashlib.blake2b(b"lora:" + adapter_digest.encode(), digest_size=8).digest()
    return int.from_bytes(root, "little")


def prompt_block_hashes(token_ids: list[int], block_size: int, root: int | None = None) -> list[int]:
    """The hash chain of every full block of ``token_ids`` (from ``root``: ``prefix_root``)."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PrefixCursor:
    """How far a reader has followed one block manager's log."""

    epoch: str
    seq: int


@dataclass(frozen=True)
class PrefixUpdate:
    """Events ``since`` a cursor: ``(hash, stored)`` in order, numbered up to ``seq``.
    With ``snapshot`` the reader starts over: ``events`` stores the whole set."""

    epoch: str
    seq: int  # events numbered below this are included
    events: tuple[tuple[int, bool], ...]
    snapshot: bool = False

    @property
    def cursor(self) -> PrefixCursor:
        return PrefixCursor(self.epoch, self.seq)


class PrefixLog:
    """The event log of one block manager's registered hashes (see the module doc).
    Written by its owner (``stored``/``removed``), read through ``since``."""

    def __init__(self, max_events: int = 1 << 16):
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._events: deque[tuple[int, bool]] = deque(maxlen=max_events)

    def stored(self, h: int) -> None:
        self._events.append((h, True))
        self.seq += 1

    def removed(self, h: int) -> None:
        self._events.append((h, False))
        self.seq += 1

    def since(self, cursor: PrefixCursor | None, current: Iterable[int]) -> PrefixUpdate:
        """What a reader at ``cursor`` missed; ``current`` is the whole set of hashes held
        now, used when the reader must start over."""
        first = self.seq - len(self._events)
        if cursor is None or cursor.epoch != self.epoch or not first <= cursor.seq <= self.seq:
            return PrefixUpdate(self.epoch, self.seq, tuple((h, True) for h in current), snapshot=True)
        missed = self.seq - cursor.seq
        return PrefixUpdate(self.epoch, self.seq, tuple(self._events[i] for i in range(-missed, 0)))
