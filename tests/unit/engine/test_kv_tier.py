"""The host KV tier (``engine.kv_tier``): prefix blocks evicted from the engine's cache
are reloaded from host memory when asked for again, outputs equal to transformers'
``generate``; a corrupted tier block is caught by its checksum and recomputed; the
prefix log keeps a hash while either tier holds it."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.engine import Engine
from splitserve.engine.sequence import Sequence
from splitserve.router.prefix_index import PrefixIndex
from splitserve.wire.config import EngineConfig
from splitserve.wire.prefix import prompt_block_hashes
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

BLOCK = 8
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tier-llama")
    hf = make_hf_checkpoint("llama", directory)
    # two prompts behind one 64-token prefix, then fillers that evict it from a 24-block cache
    shared = random_prompts([9, 14], 512, seed=3, shared_prefix=64)
    fillers = random_prompts([150, 150], 512, seed=4)
    expected = {tuple(p): hf_greedy(hf, p, PARAMS.max_tokens) for p in shared + fillers}
    return directory, shared, fillers, expected


def make_engine(directory, tier_mib: int = 1) -> Engine:
    return Engine(
        EngineConfig(
            model=str(directory),
            dtype="float32",
            attention_backend="sdpa",
            native_kernels=False,
            block_size=BLOCK,
            num_kv_blocks=24,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            host_kv_tier_mib=tier_mib,
        )
    )


def run(engine: Engine, prompt: list[int]) -> list[int]:
    return engine.generate([prompt], PARAMS)[0].token_ids


def test_an_evicted_prefix_is_reloaded_from_the_host_tier(reference):
    directory, shared, fillers, expected = reference
    engine = make_engine(directory)
    assert run(engine, shared[0]) == expected[tuple(shared[0])]
    for f in fillers:  # 150 tokens each in a 24 x 8 cache: the prefix's blocks are reused
        assert run(engine, f) == expected[tuple(f)]
    stats = engine.stats()
    assert stats.host_tier.saved >= 8 and stats.tier_hit_tokens == 0
    before = stats.prefix_hit_tokens
    assert run(engine, shared[1]) == expected[tuple(shared[1])]
    stats = engine.stats()
    assert stats.host_tier.reloaded == 8  # the whole 64-token prefix came back from the tier
    assert stats.tier_hit_tokens == 64 and stats.prefix_hit_tokens == before
    assert stats.host_tier.corrupt == 0
    # Again: the prefix is in the cache itself (a device hit); the first prompt's own
    # 9th block (its tokens 64-71), evicted with the prefix, comes from the tier.
    assert run(engine, shared[0]) == expected[tuple(shared[0])]
    stats = engine.stats()
    assert stats.host_tier.reloaded == 9 and stats.prefix_hit_tokens == before + 64


def test_a_corrupted_tier_block_is_detected_and_recomputed(reference):
    directory, shared, fillers, expected = reference
    engine = make_engine(directory)
    run(engine, shared[0])
    for f in fillers:
        run(engine, f)
    hashes = prompt_block_hashes(shared[1], BLOCK)
    tier = engine.host_tier
    assert all(h in tier for h in hashes[:8])
    tier.slot_bytes(hashes[3])[100] ^= 0xFF  # block 3 of the prefix
    assert run(engine, shared[1]) == expected[tuple(shared[1])]
    stats = engine.stats()
    assert stats.host_tier.corrupt == 1
    assert stats.host_tier.reloaded == 3  # blocks 0-2; 3 on were computed
    assert stats.tier_hit_tokens == 3 * BLOCK
    assert hashes[3] not in tier


def test_without_a_tier_an_evicted_prefix_is_computed_again(reference):
    directory, shared, fillers, expected = reference
    engine = make_engine(directory, tier_mib=0)
    run(engine, shared[0])
    for f in fillers:
        run(engine, f)
    assert run(engine, shared[1]) == expected[tuple(shared[1])]
    stats = engine.stats()
    assert stats.tier_hit_tokens == 0 and stats.host_tier.capacity_blocks == 0


def test_a_full_tier_drops_its_least_recently_used_block(reference):
    directory, *_ = reference
    engine = make_engine(directory)
    from splitserve.engine.kv_tier import HostKVTier

    tier = HostKVTier(engine.kv_cache, capacity=2)
    engine.kv_cache.tensor[:, :, 5].fill_(1.5)
    assert tier.save(11, (1,), 5) == [] and tier.save(12, (2,), 6) == []
    assert tier.holds(11, (1,))  # 11 used last: 12 is the oldest now
    assert not tier.holds(11, (9,))  # same hash, other tokens: a miss
    assert tier.save(13, (3,), 7) == [12]
    assert tier.load(11, 9) and torch.equal(engine.kv_cache.tensor[:, :, 9], engine.kv_cache.tensor[:, :, 5])
    assert not tier.load(12, 9)
    c = tier.counters()
    assert (c.held_blocks, c.saved, c.reloaded, c.dropped) == (2, 3, 1, 1)


class DictTier:
    """A tier of ``capacity`` hashes, least recently used dropped (the block manager's
    protocol, without bytes)."""

    def __init__(self, capacity: int):
        self.capacity, self.entries = capacity, {}

    def holds(self, h, tokens):
        if self.entries.get(h) != tokens:
            return False
        self.entries[h] = self.entries.pop(h)
        return True

    def save(self, h, tokens, block):
        self.entries.pop(h, None)
        dropped = []
        if len(self.entries) >= self.capacity:
            dropped.append(next(iter(self.entries)))
            del self.entries[dropped[0]]
        self.entries[h] = tokens
        return dropped

    def load(self, h, block):
        return h in self.entries

    def hashes(self):
        return list(self.entries)

    def __contains__(self, h):
        return h in self.entries


def test_the_prefix_log_follows_both_tiers():
    """Random prompts sharing prefixes through a 32-block cache over a 20-block tier: the
    router's index, following the log, always ends equal to the hashes the cache or the
    tier holds, and every admission's reloaded blocks were in the tier."""
    rng = random.Random(1)
    tier = DictTier(20)
    bm = BlockManager(num_blocks=32, block_size=4, tier=tier)
    index, live = PrefixIndex(), []
    stems = [[rng.randrange(50) for _ in range(16)] for _ in range(6)]
    reloaded = 0
    for step in range(400):
        if len(live) > 2 or (live and rng.random() < 0.5):
            bm.free(live.pop(rng.randrange(len(live))))
        tokens = rng.choice(stems)[: rng.randrange(4, 17)] + [rng.randrange(50) for _ in range(3)]
        s = Sequence("r", tokens, SamplingParams())
        cached = bm.find_cached_prefix(s)
        tiered = bm.tier_prefix(s, cached)
        n = len(tokens) - (len(cached) + tiered) * 4
        if bm.can_allocate(s, n + tiered * 4, cached):
            if cached:
                bm.take_cached_prefix(s, cached)
            got = bm.reload(s, tiered)
            reloaded += got
            assert got == tiered
            rest = len(tokens) - s.num_computed_tokens
            bm.allocate(s, rest)
            s.num_computed_tokens += rest
            bm.commit_computed(s)
            live.append(s)
        if step % 5 == 0:
            index.apply(bm.prefix_update(index.cursor))
            assert index.hashes == set(bm.hash_to_block) | set(tier.entries)
    assert reloaded > 20 and bm.tier_hits == reloaded * 4
