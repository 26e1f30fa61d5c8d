"""A hybrid model's state slots: who holds which, and the snapshots a cached prefix
starts from. No torch: slot ids index the states ``engine.state_blocks`` lays out.

A sequence that holds blocks holds ``per_sequence`` slots (``BlockManager``):

    state_slot    its state now
    state_spare   where a step writes the next one (they swap once it ran whole:
                  ``ModelRunner``)
    state_mark    with prefix caching: where a step writes the state at the last
                  block boundary it crosses, to become a snapshot

A snapshot is the state after a whole number of blocks of some sequence, kept by
the hash of its last block (``wire.prefix``) in a registry of at most
``snapshots`` slots, least recently used out first. A cached prefix of a hybrid
model is reusable only up to a block whose snapshot is registered: a sequence
that takes it starts from that snapshot (``state_from``, pinned until its first
step ran) instead of zeros. Registering gives the sequence's mark slot to the
registry and the sequence a free one: nothing is copied. A sequence keeps its
latest snapshot inside its prompt (for a prompt that extends it) and its latest
past it (for a conversation's next turn); each newer one replaces the one before.

Ownership: a slot is free, held by one sequence, or in the registry. A pinned
snapshot is not evicted.
"""

from __future__ import annotations

from collections import OrderedDict

from splitserve.engine.sequence import Sequence


class StateSlots:
    """The slots of ``sequences`` sequences at once (``per_sequence`` each: 2, or 3 with
    snapshots) and of ``snapshots`` snapshots."""

    def __init__(self, sequences: int, snapshots: int = 0):
        if sequences < 1 or snapshots < 0:
            raise ValueError("state slots need at least one sequence and no negative snapshots")
        self.per_sequence = 3 if snapshots else 2
        self.snapshots = snapshots
        self.total = self.per_sequence * sequences + snapshots
        self._free = list(range(self.total))[::-1]
        self._registry: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, oldest first
        self._pins: dict[int, int] = {}  # snapshot slot -> sequences starting from it
        # a sequence's latest snapshot in its prompt and in its output, by seq_no: a newer one
        # of the same part replaces it (the prompt's last one serves a prompt that extends
        # it, the output's last a conversation's next turn; the ones before serve less)
        self._latest: dict[int, dict[bool, int]] = {}
        self.registered = 0  # snapshots registered since start (a metric)

    # ---- a sequence's own slots ---------------------------------------------------
    def can_hold(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds its slots, or could take them now."""
        return seq.state_slot is not None or len(self._free) + self._evictable() >= self.per_sequence

    def hold(self, seq: Sequence) -> None:
        """Give ``seq`` its slots (check ``can_hold`` first)."""
        taken = [self._take() for _ in range(self.per_sequence)]
        if None in taken:
            raise RuntimeError("hold() called without free state slots")
        seq.state_slot, seq.state_spare = taken[0], taken[1]
        seq.state_mark = taken[2] if self.per_sequence == 3 else None

    def release(self, seq: Sequence) -> None:
        """``seq`` gives its slots back (and stops starting from a snapshot)."""
        self.started(seq)
        if seq.state_slot is None:
            return
        self._free += [s for s in (seq.state_mark, seq.state_spare, seq.state_slot) if s is not None]
        seq.state_slot = seq.state_spare = seq.state_mark = None
        self._latest.pop(seq.seq_no, None)  # what it registered stays, for others to start from

    # ---- snapshots --------------------------------------------------------------------
    def snapshot_prefix(self, hashes: list[int]) -> int:
        """Of a prefix whose blocks have ``hashes``, how many leading blocks end where a
        snapshot is registered (the longest such prefix; 0: none)."""
        for n in range(len(hashes), 0, -1):
            if hashes[n - 1] in self._registry:
                return n
        return 0

    def start_from(self, seq: Sequence, block_hash: int) -> None:
        """``seq`` takes a cached prefix ending with block ``block_hash``: its first step
        reads the snapshot registered for it (pinned until ``started``)."""
        slot = self._registry[block_hash]
        self._registry.move_to_end(block_hash)
        self._pins[slot] = self._pins.get(slot, 0) + 1
        seq.state_from = slot

    def started(self, seq: Sequence) -> None:
        """``seq``'s first step ran (or it ends, or its state came from elsewhere): it no
        longer reads its snapshot."""
        slot, seq.state_from = seq.state_from, None
        if slot is None:
            return
        self._pins[slot] -= 1
        if not self._pins[slot]:
            del self._pins[slot]

    def register(self, seq: Sequence, block_hash: int, in_prompt: bool) -> bool:
        """``seq``'s mark slot holds the state after its block ``block_hash`` (of its prompt,
        or past it): keep it as that block's snapshot in place of ``seq``'s previous one of
        the same part, and give ``seq`` a free mark slot. False (nothing kept) when one is
        registered for that block already or no slot can be freed for it."""
        if seq.state_mark is None or block_hash in self._registry:
            return False
        latest = self._latest.setdefault(seq.seq_no, {})
        previous = latest.get(in_prompt)
        slot = self._registry.get(previous) if previous is not None else None
        if slot is not None and slot not in self._pins:  # superseded
            del self._registry[previous]
            self._free.append(slot)
        while len(self._registry) >= self.snapshots:
            if not self._evict():
                return False
        fresh = self._take()
        if fresh is None:
            return False
        self._registry[block_hash] = seq.state_mark
        seq.state_mark = fresh
        latest[in_prompt] = block_hash
        self.registered += 1
        return True

    # ---- internals -------------------------------------------------------------------
    def _take(self) -> int | None:
        if not self._free and not self._evict():
            return None
        return self._free.pop()

    def _evictable(self) -> int:
        return sum(1 for slot in self._registry.values() if slot not in self._pins)

    def _evict(self) -> bool:
        """Free the least recently used snapshot nobody starts from; False if none."""
        for h, slot in self._registry.items():
            if slot not in self._pins:
                del self._registry[h]
                self._free.append(slot)
                return True
        return False
