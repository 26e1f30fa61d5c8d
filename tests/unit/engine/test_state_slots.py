"""``StateSlots``: who holds which state slot, and the snapshots a cached prefix of a
hybrid model starts from (the bookkeeping alone; the states themselves are
``test_hybrid_correctness``'s)."""

from __future__ import annotations

from splitserve.engine.sequence import Sequence
from splitserve.engine.state_slots import StateSlots
from splitserve.wire.sampling import SamplingParams


def seq() -> Sequence:
    return Sequence("r", [1, 2, 3], SamplingParams())


def held(s: Sequence) -> set[int]:
    return {x for x in (s.state_slot, s.state_spare, s.state_mark) if x is not None}


def test_every_slot_is_free_held_or_registered_and_comes_back():
    slots = StateSlots(sequences=2, snapshots=2)
    a, b = seq(), seq()
    slots.hold(a)
    slots.hold(b)
    assert len(held(a)) == len(held(b)) == 3 and not held(a) & held(b)
    c = seq()
    assert not slots.can_hold(c)  # 2 free slots left, 3 needed, nothing registered to evict
    assert slots.register(a, block_hash=11, in_prompt=True)
    assert slots.snapshot_prefix([5, 11, 12]) == 2 and slots.snapshot_prefix([5]) == 0
    slots.release(a)
    slots.release(b)
    assert slots.can_hold(c)
    slots.hold(c)
    d = seq()
    slots.hold(d)
    assert not slots.can_hold(seq())  # two sequences at once, as made for
    assert slots.register(c, 21, in_prompt=True) and slots.register(d, 22, in_prompt=True)
    assert slots.snapshot_prefix([5, 11]) == 0  # the least recently used went, for 22
    assert slots.snapshot_prefix([21]) == slots.snapshot_prefix([9, 22]) - 1 == 1


def test_a_pinned_snapshot_is_not_evicted_and_a_newer_one_of_the_same_part_replaces_the_older():
    slots = StateSlots(sequences=1, snapshots=1)
    a = seq()
    slots.hold(a)
    assert slots.register(a, 1, in_prompt=True)
    b = seq()
    slots.start_from(b, 1)  # b's first step reads it
    assert not slots.register(a, 2, in_prompt=True)  # the only snapshot is pinned
    slots.started(b)
    assert slots.register(a, 2, in_prompt=True)  # replaces a's older prompt snapshot
    assert slots.snapshot_prefix([1]) == 0 and slots.snapshot_prefix([1, 2]) == 2
    assert not slots.register(a, 2, in_prompt=False)  # that block has one already
