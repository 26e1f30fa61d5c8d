"""Block manager: allocation, reference counts, prefix caching, eviction."""

from __future__ import annotations

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sequence import Sequence
from splitserve.wire.sampling import SamplingParams


def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """Allocate and mark ``n`` more tokens computed, as the engine does after a step."""
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.commit_computed(s)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))
    assert bm.can_allocate(a, 10)
    compute(bm, a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    a.append_token(99)
    a.append_token(98)  # 12 tokens: still 3 blocks
    compute(bm, a, 2)
    assert len(a.block_table) == 3
    a.append_token(97)
    compute(bm, a, 1)
    assert len(a.block_table) == 4
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == []


def test_can_allocate_refuses_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(seq(list(range(9))), 9)
    assert bm.can_allocate(seq(list(range(8))), 8)


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(13)))
    compute(bm, a, 13)
    b = seq(list(range(12)) + [500, 501])
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:3]  # three full blocks in common
    bm.take_cached_prefix(b, cached)
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert all(bm.ref_counts[x] == 2 for x in cached)
    bm.free(a)
    assert all(bm.ref_counts[x] == 1 for x in cached)  # still held by b
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_last_prompt_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(8)))
    compute(bm, a, 8)
    same = seq(list(range(8)))
    # Both blocks are cached, but the block holding the last token must be recomputed.
    assert len(bm.find_cached_prefix(same)) == 1


def test_different_prefix_same_block_content_does_not_match():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a, 9)
    b = seq([0, 0, 0, 0, 5, 6, 7, 8, 9])  # second block equal, first differs
    assert bm.find_cached_prefix(b) == []


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(9)))
    compute(bm, a, 9)
    bm.free(a)
    again = seq(list(range(9)))
    assert len(bm.find_cached_prefix(again)) == 2  # still findable after free
    filler = seq(list(range(100, 116)))
    compute(bm, filler, 16)  # takes all four blocks: evicts the cached ones
    bm.free(filler)
    assert bm.find_cached_prefix(again) == []


def test_can_allocate_counts_cached_blocks_taken_from_the_free_pool():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq(list(range(9)))
    compute(bm, a, 9)
    bm.free(a)  # 3 free blocks, 2 of them cached
    b = seq(list(range(8)) + [7, 7, 7, 7, 7])
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    # 13 tokens = 4 blocks; 2 cached (taken out of the free pool), 2 new: 4 > 3 free.
    assert not bm.can_allocate(b, 5, cached)
    assert bm.can_allocate(b, 4, cached)


def test_prefix_caching_off_never_matches():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(list(range(9)))
    compute(bm, a, 9)
    assert bm.find_cached_prefix(seq(list(range(9)))) == []
