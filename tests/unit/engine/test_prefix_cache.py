"""Prefix-cache identity across processes: the named block hash, and a router following
a block manager's prefix log (``wire.prefix``, ``router.prefix_index``)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sequence import Sequence
from splitserve.router.prefix_index import PrefixIndex
from splitserve.wire.prefix import PrefixLog, prompt_block_hashes
from splitserve.wire.sampling import SamplingParams

SCRIPT = "from splitserve.wire.prefix import prompt_block_hashes as h; print(h(list(range(100)), 16))"


def test_block_hashes_are_the_same_in_every_process():
    outs = {
        subprocess.run(
            [sys.executable, "-c", SCRIPT],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert outs == {f"{prompt_block_hashes(list(range(100)), 16)}\n"}


def test_a_block_hash_names_the_whole_prefix_before_it():
    tokens = list(range(64))
    base = prompt_block_hashes(tokens, 16)
    assert len(base) == 4 and len(set(base)) == 4
    assert prompt_block_hashes(tokens + [1, 2, 3], 16) == base  # a partial block has no hash
    changed = prompt_block_hashes(tokens[:20] + [999] + tokens[21:], 16)  # a token of block 1
    assert changed[0] == base[0] and all(a != b for a, b in zip(changed[1:], base[1:]))
    # The same block after a different prefix is a different block.
    assert prompt_block_hashes([5] * 32, 16)[1] != prompt_block_hashes([6] * 16 + [5] * 16, 16)[1]


def _compute(bm: BlockManager, tokens: list[int]) -> Sequence:
    s = Sequence("r", tokens, SamplingParams())
    cached = bm.find_cached_prefix(s)
    if cached:
        bm.take_cached_prefix(s, cached)
    n = len(tokens) - s.num_computed_tokens
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.commit_computed(s)
    return s


def test_a_router_following_the_log_knows_what_the_cache_holds():
    """Random prompts (sharing prefixes) computed and freed until blocks are evicted; the
    index, polled now and then with two polls sometimes answered from one cursor, always
    ends equal to the block manager's own set of registered hashes."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4)
    index, live = PrefixIndex(), []
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(5)]
    for step in range(300):
        if len(live) > 3 or (live and rng.random() < 0.4):
            bm.free(live.pop(rng.randrange(len(live))))
        tokens = rng.choice(stems)[: rng.randrange(4, 13)] + [
            rng.randrange(50) for _ in range(rng.randrange(1, 9))
        ]
        s = Sequence("r", tokens, SamplingParams())
        if bm.can_allocate(s, len(tokens)):
            live.append(_compute(bm, tokens))
        if step % 7 == 0:
            cursor = index.cursor
            first, second = bm.prefix_update(cursor), None
            if rng.random() < 0.3:  # a status call polled with the same cursor
                second = bm.prefix_update(cursor)
            index.apply(first)
            if second is not None:
                index.apply(second)
                index.apply(first)  # a late duplicate changes nothing
            assert index.hashes == set(bm.hash_to_block)
    assert bm.prefix_log.seq > 100  # evictions happened: both kinds of event were followed


def test_a_reader_too_far_behind_or_from_another_epoch_gets_the_whole_set():
    log = PrefixLog(max_events=4)
    held = set()
    for h in range(10):
        log.stored(h)
        held.add(h)
    index = PrefixIndex()
    index.apply(log.since(None, held))
    assert index.hashes == held
    stale = index.cursor
    for h in range(10, 16):  # more than the log keeps
        log.stored(h)
        held.add(h)
    update = log.since(stale, held)
    assert update.snapshot
    index.apply(update)
    assert index.hashes == held
    restarted = PrefixLog()
    restarted.stored(99)
    update = restarted.since(index.cursor, {99})
    assert update.snapshot and update.epoch != index.cursor.epoch
    index.apply(update)
    assert index.hashes == {99}
