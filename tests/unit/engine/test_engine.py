"""The engine's public API on a tiny random-weight Llama: validation that leaves
nothing allocated, abort, the prefill/decode halves, seeds, logprobs, limits."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import InvalidRequest, ModelLoadError, Overloaded, UnknownRequest
from splitserve.wire.sampling import FinishReason, SamplingParams
from tests.conftest import random_prompts, tiny_hf_config

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture()
def engine(checkpoint):
    return Engine(
        EngineConfig(model=str(checkpoint), dtype="float32", block_size=8, max_num_batched_tokens=64)
    )


def assert_clean(engine: Engine) -> None:
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished()
    assert engine.requests == {}


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "empty"),
        ("", GREEDY, "empty"),
        ([1] * 1024, GREEDY, "context"),
        ([1] * 1000, SamplingParams(max_tokens=100), "max_tokens"),
        ([1, 2, 99999], GREEDY, r"\[0, 512\)"),
        ([1, 2, -1], GREEDY, r"\[0, 512\)"),
        ("hello", GREEDY, "tokenizer"),
    ],
)
def test_bad_requests_raise_and_leave_nothing_allocated(engine, prompt, params, match):
    with pytest.raises(InvalidRequest, match=match):
        engine.add_request(prompt, params)
    assert_clean(engine)
    assert isinstance(InvalidRequest("x"), ValueError)


def test_bad_sampling_values_are_rejected_at_construction():
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams(top_p=1.2)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request([1, 2, 3], GREEDY, request_id="a")
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request([1, 2, 3], GREEDY, request_id="a")
    engine.abort("a")
    assert_clean(engine)


def test_abort_mid_generation_frees_blocks(engine):
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
        for p in random_prompts([30, 70], 512)
    ]
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert all(engine.abort(i) for i in ids)
    assert not engine.abort(ids[0])  # already gone
    assert_clean(engine)


def test_max_tokens_and_logprobs(engine):
    out = engine.generate(
        random_prompts([10], 512), SamplingParams(max_tokens=7, ignore_eos=True, logprobs=True)
    )[0]
    assert len(out.token_ids) == 7 and out.finish_reason == FinishReason.LENGTH
    assert len(out.logprobs) == 7 and all(lp <= 0 for lp in out.logprobs)


def test_stop_token_ids_end_the_request(engine):
    prompt = random_prompts([12], 512)[0]
    free = engine.generate([prompt], GREEDY)[0].token_ids
    stop_at = free[4]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]))[
        0
    ]
    assert out.token_ids == free[: free.index(stop_at) + 1]
    assert out.finish_reason == FinishReason.STOP


def test_seeded_sampling_reproduces_across_batches(engine):
    prompt = random_prompts([20], 512)[0]
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    alone = engine.generate([prompt], p)[0].token_ids
    others = random_prompts([5, 40, 9], 512, seed=9)
    crowd = engine.generate(others + [prompt], [SamplingParams(max_tokens=10, temperature=1.0)] * 3 + [p])
    assert crowd[3].token_ids == alone
    other_seed = engine.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=8, ignore_eos=True)
    )
    assert other_seed[0].token_ids != alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_resumed_request_continues_the_undisturbed_run(engine, temperature):
    """Given the tokens already generated (a request resumed after a lost worker), the
    engine continues exactly as the undisturbed run did, seeded sampling included,
    emits only the new tokens, and counts the old ones toward max_tokens."""
    prompt = random_prompts([20], 512, seed=4)[0]
    p = SamplingParams(max_tokens=12, temperature=temperature, seed=11, ignore_eos=True)
    whole = engine.generate([prompt], p)[0].token_ids
    for k in (1, 5, 11):
        rid = engine.add_request(prompt, p, output_token_ids=whole[:k])
        emitted = []
        while engine.has_unfinished():
            emitted += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        assert emitted == whole[k:], k
    with pytest.raises(InvalidRequest, match="already generated"):
        engine.add_request(prompt, p, output_token_ids=whole)
    assert_clean(engine)


def test_prefill_half_then_decode_half_equals_monolithic(checkpoint):
    cfg = dict(model=str(checkpoint), dtype="float32", block_size=8, max_num_batched_tokens=32)
    prefill, decode, mono = (Engine(EngineConfig(**cfg)) for _ in range(3))
    prompts = random_prompts([5, 37, 64, 90], 512)
    expected = [o.token_ids for o in mono.generate(prompts, GREEDY)]

    ids = [prefill.add_request(p, GREEDY, prefill_only=True) for p in prompts]
    while prefill.has_unfinished():
        for out in prefill.step():
            assert out.finished and out.finish_reason == FinishReason.PREFILL_DONE
    used = prefill.block_manager.num_used_blocks
    assert used > 0  # held for the transfer
    for rid, p, exp in zip(ids, prompts, expected):
        done = prefill.prefilled(rid)
        assert done.output_token_ids == exp[:1] and done.num_kv_tokens == len(p)
        kv = prefill.kv_cache.read_blocks(done.block_ids)
        blocks = decode.import_request(rid, done.prompt_token_ids, done.output_token_ids, GREEDY)
        decode.kv_cache.write_blocks(blocks, kv)
        decode.activate(rid)
        prefill.release(rid)
    assert prefill.block_manager.num_used_blocks == 0
    with pytest.raises(UnknownRequest):
        prefill.release(ids[0])
    got = {}
    while decode.has_unfinished():
        for out in decode.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [exp[:1] + got[rid] for rid, exp in zip(ids, expected)] == expected
    assert_clean(decode)


def test_a_decode_engine_holding_a_prefix_imports_only_the_tail(checkpoint):
    """The decode side holds a 64-token prefix (its cache), later the whole prompt's
    full blocks (after eviction, its host tier); the prefill side exports only the
    blocks after them; greedy output equals a
    whole engine's, and only the tail's bytes moved."""
    cfg = dict(model=str(checkpoint), dtype="float32", block_size=8, max_num_batched_tokens=32)
    prefill, mono = Engine(EngineConfig(**cfg)), Engine(EngineConfig(**cfg))
    decode = Engine(EngineConfig(**cfg, num_kv_blocks=24, host_kv_tier_mib=1))
    prefix = random_prompts([64], 512, seed=5)[0]
    warm, prompt, filler = prefix + [7, 8, 9], prefix + random_prompts([21], 512, seed=6)[0], [3] * 150
    expected = mono.generate([prompt], GREEDY)[0].token_ids
    decode.generate([warm], GREEDY)  # the decode side's cache now holds the prefix

    def hand_over(rid: str) -> int:
        held = decode.hold_prefix(rid, prompt, GREEDY)
        prefill.add_request(prompt, GREEDY, rid, prefill_only=True, export_from_block=held // 8)
        while prefill.has_unfinished():
            prefill.step()
        done = prefill.prefilled(rid)
        assert done.num_kv_tokens == len(prompt) - held
        blocks = decode.import_request(rid, prompt, done.output_token_ids, GREEDY)
        assert len(blocks) == len(done.block_ids) == -(-(len(prompt) - held) // 8)
        decode.kv_cache.write_blocks(blocks, prefill.kv_cache.read_blocks(done.block_ids))
        decode.activate(rid)
        prefill.release(rid)
        got = list(done.output_token_ids)
        while decode.has_unfinished():
            got += [t for o in decode.step() for t in o.new_token_ids]
        assert got == expected
        return held

    assert hand_over("a") == 64  # from the cache
    decode.generate([filler], GREEDY)  # evicts the prefix into the host tier
    # "a"'s import registered every full block of the prompt: all 10 are held, those the
    # filler evicted (the last ones: a sequence frees its tail first) from the host tier
    before = decode.stats().prefix_hit_tokens
    assert hand_over("b") == 80
    stats = decode.stats()
    assert stats.tier_hit_tokens >= 8 and stats.tier_hit_tokens + stats.prefix_hit_tokens - before == 80
    assert stats.import_held_tokens == 64 + 80
    assert stats.import_moved_tokens == (len(prompt) - 64) + (len(prompt) - 80)
    # Nothing held: the whole prompt moves; a held request that is aborted frees its blocks.
    assert decode.hold_prefix("c", [1] * 40, GREEDY) == 0 and "c" not in decode.requests
    decode.generate([filler], GREEDY)
    assert decode.hold_prefix("d", filler, GREEDY) == 144
    assert decode.abort("d") and decode.block_manager.num_used_blocks == 0
    with pytest.raises(InvalidRequest, match="at most the 8 full blocks"):
        prefill.add_request(prompt[:65], GREEDY, prefill_only=True, export_from_block=9)


def test_a_prefix_lent_by_one_engine_is_adopted_by_another_and_not_computed_again(checkpoint):
    """Engine A computed a 64-token prefix; B holds its first 3 blocks already, reserves
    the other 5, copies A's lent blocks in, adopts them, and then prefills a prompt
    starting with the prefix computing only the tail: output equals a whole engine's.
    A lends nothing it does not hold; B adopting fewer blocks than it reserved keeps only
    those; an aborted reservation frees everything."""
    cfg = dict(model=str(checkpoint), dtype="float32", block_size=8, max_num_batched_tokens=32)
    a, b, mono = (Engine(EngineConfig(**cfg)) for _ in range(3))
    prefix = random_prompts([64], 512, seed=15)[0]
    prompt = prefix + random_prompts([13], 512, seed=16)[0]
    expected = mono.generate([prompt], GREEDY)[0].token_ids
    a.generate([prefix + [1, 2]], GREEDY)  # A's cache holds the prefix's 8 blocks
    b.generate([prefix[:24] + [3]], GREEDY)  # B's holds the first 3

    held, blocks = b.reserve_prefix("p", prefix)
    assert (held, len(blocks)) == (3, 5)
    lent = a.lend_prefix("p", prefix, from_block=held)
    assert lent is not None and len(lent.block_ids) == 5 and lent.num_kv_tokens == 40
    assert a.stats().prefix_lent_tokens == 40 and a.stats().prefix_hit_tokens == 0
    b.kv_cache.write_blocks(blocks, a.kv_cache.read_blocks(lent.block_ids))
    a.release("p")
    assert a.block_manager.num_used_blocks == 0
    assert b.adopt_prefix("p", 8) == 40 and "p" not in b.requests
    before = b.stats().prefix_hit_tokens
    out = b.generate([prompt], GREEDY)[0]
    assert out.token_ids == expected and out.num_cached_tokens == 64
    assert b.stats().prefix_pulled_tokens == 40 and b.stats().prefix_hit_tokens - before == 64

    assert a.lend_prefix("q", random_prompts([32], 512, seed=17)[0], 0) is None and not a.requests
    assert a.lend_prefix("r", prefix, from_block=8) is None and a.block_manager.num_used_blocks == 0
    other = random_prompts([32], 512, seed=18)[0]
    held, blocks = b.reserve_prefix("s", other)
    assert (held, len(blocks)) == (0, 4)
    assert b.adopt_prefix("s", 0) == 0  # the copy failed: nothing joins the cache
    assert b.block_manager.find_cached_prefix(b._sequence("t", other + [1], GREEDY)) == []
    b.reserve_prefix("u", other)
    assert b.abort("u") and b.block_manager.num_used_blocks == 0
    with pytest.raises(InvalidRequest, match="whole number of blocks"):
        b.reserve_prefix("v", prefix[:20])


def test_import_two_phase_and_abort_before_activate(engine):
    blocks = engine.import_request("x", list(range(20)), [5], GREEDY)
    assert len(blocks) == 3 and engine.block_manager.num_used_blocks == 3
    assert not engine.has_unfinished()  # not scheduled until activate()
    engine.abort("x")
    assert_clean(engine)
    with pytest.raises(UnknownRequest):
        engine.activate("x")


def test_import_with_wrong_kv_shape_is_refused_and_freed(engine):
    blocks = engine.import_request("y", list(range(20)), [5], GREEDY)
    with pytest.raises(ValueError, match="shape"):
        engine.kv_cache.write_blocks(blocks, torch.zeros(1, 2, 3))
    engine.abort("y")
    assert_clean(engine)


def test_import_when_cache_is_full_raises_overloaded(checkpoint):
    small = Engine(EngineConfig(model=str(checkpoint), dtype="float32", block_size=8, num_kv_blocks=4))
    small.import_request("a", list(range(20)), [1], GREEDY)  # 3 of its 4 blocks
    with pytest.raises(Overloaded):
        small.import_request("b", list(range(20)), [1], GREEDY)
    small.abort("a")
    assert_clean(small)


def test_random_weights_from_a_config(checkpoint):
    cfg = dict(model=str(checkpoint), dtype="float32", random_weights=True)
    a, b = Engine(EngineConfig(**cfg, seed=1)), Engine(EngineConfig(**cfg, seed=1))
    c = Engine(EngineConfig(**cfg, seed=2))
    prompts = random_prompts([16, 30], 512)
    out_a, out_b, out_c = (e.generate(prompts, GREEDY) for e in (a, b, c))
    assert [o.token_ids for o in out_a] == [o.token_ids for o in out_b]
    assert [o.token_ids for o in out_a] != [o.token_ids for o in out_c]
    in_memory = Engine(EngineConfig(dtype="float32", seed=1), hf_config=tiny_hf_config("llama"))
    assert [o.token_ids for o in in_memory.generate(prompts, GREEDY)] == [o.token_ids for o in out_a]


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config

    with pytest.raises(ModelLoadError, match="not supported"):
        Engine(EngineConfig(), hf_config=GPT2Config())


def test_measure_rates_gives_a_fresh_engine_its_prompt_rate_and_step_time_and_leaves_it_idle(engine):
    stats = engine.stats()
    assert stats.prefill_tokens_per_s == 0.0 and stats.decode_step_s == 0.0  # nothing run yet
    rate, step_s = engine.measure_rates(100)
    stats = engine.stats()
    assert rate > 0 and stats.prefill_tokens_per_s == rate
    assert step_s > 0 and stats.decode_step_s == step_s and stats.decode_batch == 1
    assert_clean(engine)
    out = engine.generate(random_prompts([20], 512, seed=3), GREEDY)[0]  # serves as before
    assert len(out.token_ids) == GREEDY.max_tokens
    engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        engine.measure_rates(10)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prompt_logprobs_equal_transformers_log_softmax(checkpoint, prefix_caching):
    """Each prompt token's logprob given the ones before it, and the top-3 at each
    position, equal transformers' float32 ``log_softmax`` within 1e-4: a prompt longer
    than the prefill chunk, batched with a plain request, twice (the second time its
    blocks are in the prefix cache, which a prompt that asks for logprobs must not use)."""
    from transformers import AutoModelForCausalLM

    engine = Engine(
        EngineConfig(
            model=str(checkpoint),
            dtype="float32",
            block_size=8,
            max_num_batched_tokens=32,
            enable_prefix_caching=prefix_caching,
        )
    )
    prompt, other = random_prompts([75, 20], 512, seed=21)
    asks = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for _ in range(2):
        got, _ = engine.generate([prompt, other], [asks, GREEDY])
        assert len(got.prompt_logprobs) == len(prompt) - 1
        for i, (value, top) in enumerate(got.prompt_logprobs):
            assert abs(value - ref[i, prompt[i + 1]].item()) < 1e-4, i
            best = ref[i].topk(3)
            assert [t for t, _ in top] == best.indices.tolist()
            assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert_clean(engine)
