"""Scheduler: token budget, chunked prefill, decode-first batching, preemption."""

from __future__ import annotations

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.wire.sampling import SamplingParams


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(bm, budget, max_seqs), bm


def add(s: Scheduler, n: int, rid: str) -> Sequence:
    seq = Sequence(rid, list(range(n)), SamplingParams(max_tokens=100))
    s.add(seq)
    return seq


def finish_step(out) -> None:
    """What the engine does after the model ran: count tokens, append a sample."""
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        if samples:
            item.seq.append_token(7)


def test_long_prompt_is_chunked_by_the_budget():
    s, _ = make(budget=16)
    a = add(s, 40, "a")
    sizes = []
    while a.num_output_tokens == 0:
        out = s.schedule()
        sizes.append(out.num_tokens)
        finish_step(out)
    assert sizes == [16, 16, 8]


def test_decodes_go_first_and_prefill_fills_the_rest_of_the_budget():
    s, _ = make(budget=16)
    add(s, 4, "a")
    finish_step(s.schedule())  # a prefilled, now decoding
    b = add(s, 40, "b")
    out = s.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 15)]
    assert not [x for x in out.scheduled if x.seq is b][0].samples


def test_max_num_seqs_caps_admission():
    s, _ = make(budget=100, max_seqs=2)
    for i in range(4):
        add(s, 3, str(i))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_preemption_frees_the_newest_and_requeues_it_first():
    s, bm = make(num_blocks=4, block_size=4, budget=64)
    a = add(s, 8, "a")  # 2 blocks
    b = add(s, 8, "b")  # 2 blocks: the pool is full
    finish_step(s.schedule())
    assert bm.num_free_blocks == 0
    # Both now hold 9 tokens and need a third block each.
    out = s.schedule()
    assert out.preempted == [b]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b
    assert [x.seq for x in out.scheduled] == [a]


def test_sequence_larger_than_the_cache_is_reported_unschedulable():
    s, _ = make(num_blocks=2, block_size=4, budget=64)
    big = add(s, 12, "big")
    out = s.schedule()
    assert out.unschedulable == [big] and not out.scheduled
