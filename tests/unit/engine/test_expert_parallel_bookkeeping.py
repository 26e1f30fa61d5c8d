"""The bookkeeping expert parallelism adds, on one process: a block manager split
into one shard per rank (a sequence's blocks all in one shard; prefix hits within
a shard; preemption within the shard that ran out), a step split into each rank's
own sequences and put back together in order, the expert load window, and the
configurations refused with a sentence."""

from __future__ import annotations

import pytest

from splitserve.engine.attention import SeqSpan
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.parallel_fit import check_ep_compatible
from splitserve.engine.model_runner import StepInputs
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence
from splitserve.engine.step_rates import ExpertLoad
from splitserve.wire.config import EngineConfig
from splitserve.wire.outputs import rank_loads
from splitserve.wire.sampling import SamplingParams
from tests.conftest import tiny_hf_config


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=100))


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.commit_computed(s)


def test_each_sequence_lives_in_one_shard_the_emptiest_when_it_starts():
    bm = BlockManager(num_blocks=12, block_size=4, shards=3)  # shard s: blocks [4s, 4s + 4)
    a, b, c = seq("a", list(range(9))), seq("b", list(range(100, 105))), seq("c", list(range(200, 203)))
    compute(bm, a, 9)  # 3 blocks, shard 0 (all equal: the first)
    compute(bm, b, 5)  # shard 1 (4 free, as shard 2)
    compute(bm, c, 3)  # shard 2
    assert {bm.shard_of(x) for x in a.block_table} == {0}
    assert {bm.shard_of(x) for x in b.block_table} == {1}
    assert {bm.shard_of(x) for x in c.block_table} == {2}
    assert bm.locate(b.block_table) == (1, [x - 4 for x in b.block_table])
    a.append_token(1)
    a.append_token(2)
    a.append_token(3)
    assert not bm.can_allocate(a, 8)  # 5 blocks: its shard holds 4; 5 are free elsewhere
    assert bm.can_allocate(a, 7)
    compute(bm, a, 3)  # grows within its shard
    assert {bm.shard_of(x) for x in a.block_table} == {0}
    bm.free(a)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 12


def test_prefix_hits_stay_in_their_shard():
    bm = BlockManager(num_blocks=8, block_size=4, shards=2)
    a = seq("a", list(range(12)))
    compute(bm, a, 12)  # shard 0, three full blocks registered; one left free there
    b = seq("b", list(range(12)) + [99, 98])
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:3]
    assert bm.home(b, cached) == 0  # where its prefix is, though shard 1 is emptier
    assert bm.can_allocate(b, 2, cached)


def test_preemption_takes_the_newest_sequence_of_the_shard_that_ran_out():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, shards=2)
    s = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    seqs = [seq(r, list(range(7))) for r in "abcd"]  # 2 blocks each: a, c on shard 0; b, d on 1
    for x in seqs:
        s.add(x)
    out = s.schedule()
    assert [bm.home(x) for x in seqs] == [0, 1, 0, 1]
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.append_token(5)
    seqs[0].append_token(6)  # a needs a third block: its shard is full
    out = s.schedule()
    assert out.preempted == [seqs[2]]  # c (shard 0), not d, the newest overall (shard 1)


def test_a_step_splits_into_each_ranks_sequences_and_back_in_order():
    bs, per = 4, 10  # rank r's block ids: [10r, 10r + 10)
    spans = [
        SeqSpan(0, 1, 6, [12, 15]),  # decode, rank 1
        SeqSpan(1, 1, 3, [3]),  # decode, rank 0
        SeqSpan(2, 3, 3, [4]),  # prefill, rank 0
        SeqSpan(5, 2, 7, [17, 18]),  # prefill chunk, rank 1
    ]
    slots = [15 * bs + 1, 3 * bs + 2, 16, 17, 18, 18 * bs + 1, 18 * bs + 2]
    inputs = StepInputs(list(range(100, 107)), [5, 2, 0, 1, 2, 5, 6], slots, spans, 2, [0, 1, 4, 6], [2, 3])
    r0, r1 = inputs.for_rank(0, per, bs), inputs.for_rank(1, per, bs)
    assert r0.input_ids == [101, 102, 103, 104] and r1.input_ids == [100, 105, 106]
    assert (r0.num_decodes, r1.num_decodes) == (1, 1)
    assert [s.block_table for s in r1.spans] == [[2, 5], [7, 8]]
    assert r1.slots == [5 * bs + 1, 8 * bs + 1, 8 * bs + 2]
    assert [s.q_start for s in r1.spans] == [0, 1]
    assert (r0.last_index, r0.prompt_index) == ([0, 3], [1, 2])
    assert (r1.last_index, r1.prompt_index) == ([0, 2], [])
    counts, order = inputs.gather_plan(per, 2)
    gathered = [("r0", p) for p in r0.last_index + r0.prompt_index] + [("r1", p) for p in r1.last_index]
    assert counts == [4, 2]
    # this step's order: last_index 0 (r1 0), 1 (r0 0), 4 (r0 3), 6 (r1 2); prompt 2 (r0 1), 3 (r0 2)
    assert [gathered[i] for i in order] == [("r1", 0), ("r0", 0), ("r0", 3), ("r1", 2), ("r0", 1), ("r0", 2)]


def test_expert_load_counts_whole_windows():
    now = [0.0]
    load = ExpertLoad(4, window_s=10.0, clock=lambda: now[0])
    load.add([1, 0, 2, 0])
    now[0] = 4.0
    load.add([0, 3, 0, 0])
    assert load.recent == () and load.total == [1, 3, 2, 0]  # no whole window yet
    now[0] = 11.0
    load.add([5, 0, 0, 1])
    assert load.recent == (6, 3, 2, 1) and load.recent_s == 11.0
    now[0] = 22.0
    load.add([0, 0, 0, 2])
    assert load.recent == (0, 0, 0, 2) and load.total == [6, 3, 2, 3]
    assert rank_loads(load.total, 2) == [9, 5]
    assert rank_loads(load.total, 1) == [14]


def test_expert_parallelism_is_refused_with_a_sentence():
    with pytest.raises(ValueError, match="tp_size must be 1"):
        EngineConfig(ep_size=2, tp_size=2)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_ep_compatible(ModelConfig.from_hf(tiny_hf_config("llama")), 2)
    with pytest.raises(ValueError, match="does not divide the model's 4 routed experts"):
        check_ep_compatible(ModelConfig.from_hf(tiny_hf_config("mixtral")), 3)
    with pytest.raises(ValueError, match="fp8"):
        check_ep_compatible(ModelConfig.from_hf(tiny_hf_config("mixtral")), 2, "fp8")
    check_ep_compatible(ModelConfig.from_hf(tiny_hf_config("deepseek_v3")), 4)
