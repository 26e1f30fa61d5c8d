"""Hybrid models (Qwen3-Next, Qwen3.5: Gated DeltaNet layers beside gated full
attention) in one engine: float32 greedy output equals transformers' ``generate``,
token for token.

Tiny random checkpoints of each (``tests.conftest.tiny_hf_config``: three linear
layers to one full, two seeds), prompts longer than the 32-token prefill chunk (the
linear layers' state carried from chunk to chunk), batched, fewer state slots than
requests (slots reused as sequences end), and a cache too small for the batch
(preemption: the state recomputed from scratch with the KV). A cached prefix
starts from the state snapshot kept at its last block: a prompt that extends an
earlier one, and a conversation's next turn, reuse what came before and give the
same tokens. What they do not run yet is refused with a sentence.
"""

from __future__ import annotations

import pytest

from splitserve.engine.engine import Engine
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.parallel_fit import check_tp_compatible
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.errors import ModelLoadError
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts, tiny_hf_config

MAX_NEW = 12
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=[("qwen3_next", 0), ("qwen3_5_text", 0), ("qwen3_5_text", 1)])
def reference(request, tmp_path_factory):
    kind, seed = request.param
    directory = tmp_path_factory.mktemp(f"{kind}-{seed}")
    hf = make_hf_checkpoint(kind, directory, seed=seed)
    prompts = random_prompts([3, 17, 47, 90], 512, seed=seed + 1)
    prompts += random_prompts([60, 71], 512, seed=seed + 2, shared_prefix=40)
    return directory, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def make_engine(directory, **overrides) -> Engine:
    cfg = dict(
        model=str(directory),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        kv_cache_memory_mib=32,
    )
    return Engine(EngineConfig(**(cfg | overrides)))


def test_hybrid_greedy_equals_transformers(reference):
    directory, prompts, expected = reference
    engine = make_engine(directory)
    layout = engine.kv_cache.layout
    assert layout.num_layers == 1 and len(engine.kv_cache.states) == 3  # KV for the full layer only
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert engine.block_manager.num_used_blocks == 0
    plain = make_engine(directory, enable_prefix_caching=False)
    assert [o.token_ids for o in plain.generate(prompts, PARAMS)] == expected


def test_hybrid_greedy_equals_transformers_with_few_slots_and_preemption(reference):
    directory, prompts, expected = reference
    few = make_engine(directory, max_num_seqs=2)  # 6 requests through 2 state slots
    assert [o.token_ids for o in few.generate(prompts, PARAMS)] == expected
    tight = make_engine(directory, num_kv_blocks=24, kv_cache_memory_mib=None)  # < the batch's blocks
    assert [o.token_ids for o in tight.generate(prompts, PARAMS)] == expected
    assert tight.scheduler.num_preemptions > 0


def test_what_a_hybrid_model_does_not_run_yet_is_refused(reference):
    directory, _, _ = reference
    with pytest.raises(ValueError, match="kv_cache_dtype fp8"):
        make_engine(directory, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="choose ngram"):
        make_engine(directory, speculative=SpeculativeConfig(method="self", draft_layers=1))
    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3_5_text"))  # 2 linear key heads
    with pytest.raises(ValueError, match=r"linear-attention key heads \(2\) to divide by 4"):
        check_tp_compatible(cfg, 4)


def test_a_hybrid_config_with_an_unknown_layer_type_fails_at_load():
    hf = tiny_hf_config("qwen3_5_text")
    hf.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(ModelLoadError, match="layer_types has 'sliding_attention'"):
        ModelConfig.from_hf(hf)


def test_a_step_that_fails_after_the_linear_layers_wrote_runs_again_exactly(reference):
    """The full-attention layer (after the three linear ones) raises once mid-decode: the
    step runs again (``engine.containment``) from the states it started from (a step
    writes each sequence's next state to its spare slot, and the sequence takes it only
    once the step ran whole), so every request still gives transformers' tokens."""
    directory, prompts, expected = reference
    engine = make_engine(directory)
    layer = engine.runner.model.layers[3]
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:  # a decode step of the whole batch, its linear layers done
            raise RuntimeError("the full layer broke")
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = failing
    retried = engine.containment.retried
    outs = engine.generate(prompts, PARAMS)
    assert engine.containment.retried == retried + 1 and len(calls) > 6
    assert [o.token_ids for o in outs] == expected


def test_speculation_gives_the_tokens_of_decoding_without_it(reference):
    """Drafts verified in one step: where all are kept, the state the step left is the
    sequence's; where one is rejected, the state goes back to before the step and the
    kept tokens are computed again (``engine._rewind_state``): both exact. The n-gram
    proposer's drafts are rarely right on these random models, so a proposer that
    knows transformers' tokens stands in for it, and spoils every other draft's last
    token: drafts kept whole and drafts cut short, at every position."""
    directory, prompts, expected = reference
    spec = SpeculativeConfig(method="ngram", num_tokens=3, adaptive=False)
    engine = make_engine(directory, speculative=spec)
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected  # n-gram's own drafts
    following = {tuple(p): p + e for p, e in zip(prompts, expected)}
    calls = []

    def oracle(requests):
        drafts = []
        for r in requests:
            whole = next(w for p, w in following.items() if list(r.token_ids[: len(p)]) == list(p))
            draft = whole[len(r.token_ids) : len(r.token_ids) + r.k]
            calls.append(1)
            if draft and len(calls) % 2:
                draft[-1] = (draft[-1] + 1) % 512  # wrong: the target cuts the draft there
            drafts.append(draft)
        return drafts

    engine.speculation.proposer.propose = oracle
    before = engine.stats().speculation
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    counted = engine.stats().speculation
    proposed = counted.proposed_tokens - before.proposed_tokens
    accepted = counted.accepted_tokens - before.accepted_tokens
    assert proposed > accepted > proposed // 2  # most kept, some cut short


def test_a_prompt_that_extends_an_earlier_one_and_a_next_turn_start_from_its_state(reference, tmp_path):
    """The state after a whole number of blocks is kept as a snapshot by the block's
    hash: a prompt that extends an earlier prompt takes the earlier one's blocks and
    starts from its snapshot at their end; a conversation's next turn (the first
    turn's prompt and answer, then more) takes the first turn's blocks past its prompt
    too, from the snapshot in its answer. The tokens are those computed without a
    cache; transformers' for the first turn."""
    directory, prompts, expected = reference
    engine = make_engine(directory)
    first = prompts[3]  # 90 tokens
    out = engine.generate([first], PARAMS)[0]
    assert out.token_ids == expected[3] and out.num_cached_tokens == 0
    extended = first + [7, 8, 9, 10, 11]
    turn = first + out.token_ids + [12, 13, 14]
    fresh = make_engine(directory, enable_prefix_caching=False)
    want = [o.token_ids for o in fresh.generate([extended, turn], PARAMS)]
    got = engine.generate([extended], PARAMS) + engine.generate([turn], PARAMS)
    assert [o.token_ids for o in got] == want
    assert got[0].num_cached_tokens == len(first) // 8 * 8  # 88: the prompt's last whole block
    assert got[1].num_cached_tokens > len(first)  # into the first turn's answer
    assert engine.block_manager.states.registered > 0
