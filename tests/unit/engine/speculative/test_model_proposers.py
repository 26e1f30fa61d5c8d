"""The model proposers (``speculative.draft``): a draft model and the target's own
first layers. Greedy tokens equal transformers' ``generate`` with either, for tiny
random models of every family; the draft's paged KV is right (a draft that is the
target itself, in float32, has every proposal accepted: a draft cache that caught
up wrongly after a rejection, or after a request was preempted, would propose other
tokens); its cache follows the engine's requests and evicts the least recently used
when full."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.engine import Engine
from splitserve.engine.speculative import ProposalRequest
from splitserve.engine.speculative.draft import EarlyExit, ModelProposer
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

MAX_NEW = 24
FAMILIES = ["llama", "qwen3", "mixtral", "deepseek_v3"]


def _engine(directory, speculative, **overrides) -> Engine:
    cfg = dict(model=str(directory), dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    return Engine(EngineConfig(**(cfg | overrides), speculative=speculative))


def _expected(hf, prompts):
    return [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_draft_model_gives_transformers_greedy_tokens(family, tmp_path):
    hf = make_hf_checkpoint(family, tmp_path / "target")
    make_hf_checkpoint(family, tmp_path / "draft", seed=7)  # another model, the same vocabulary
    prompts = random_prompts([5, 12, 31], 512, seed=3)
    spec = SpeculativeConfig(method="draft", num_tokens=3, draft_model=str(tmp_path / "draft"))
    engine = _engine(tmp_path / "target", spec)
    out = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in out] == _expected(hf, prompts)
    assert engine.stats().speculation.proposed_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_self_speculation_gives_transformers_greedy_tokens(family, tmp_path):
    hf = make_hf_checkpoint(family, tmp_path)
    prompts = random_prompts([5, 12, 31], 512, seed=4)
    engine = _engine(tmp_path, SpeculativeConfig(method="self", num_tokens=3, draft_layers=1))
    out = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in out] == _expected(hf, prompts)
    assert engine.stats().speculation.proposed_tokens > 0


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_the_target_as_its_own_draft_has_every_proposal_accepted(family, tmp_path):
    """Greedy in float32, a draft equal to the target proposes exactly the target's
    tokens, so every one is kept, also across preemptions (a KV cache of 24 blocks
    for 4 prompts that grow past it) and prompts longer than one step's budget. (A
    draft as slow as its target is not worth running, and the price rule would not
    run it: adaptive k is off, 4 tokens every step it may.)"""
    hf = make_hf_checkpoint(family, tmp_path)
    prompts = random_prompts([5, 40, 77, 9], 512, seed=5)
    spec = SpeculativeConfig(method="draft", num_tokens=4, draft_model=str(tmp_path), adaptive=False)
    engine = _engine(tmp_path, spec, num_kv_blocks=24, max_model_len=128)
    out = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in out] == _expected(hf, prompts)
    counters = engine.stats().speculation
    assert counters.proposed_tokens > len(prompts) * MAX_NEW // 2, counters
    assert counters.accepted_tokens == counters.proposed_tokens, counters


def test_an_early_exit_through_every_layer_is_the_target(tmp_path):
    """``EarlyExit`` over all of the target's layers proposes the target's greedy
    continuation (the view runs the same layers, norm and head)."""
    hf = make_hf_checkpoint("llama", tmp_path)
    engine = _engine(tmp_path, SpeculativeConfig(method="self", num_tokens=4, draft_layers=1))
    proposer = engine.speculation.proposer
    layers = engine.model_config.num_layers
    proposer.runner.model = EarlyExit(engine.model, layers)
    proposer.runner.kv_cache = _full_cache(engine, proposer)
    prompt = random_prompts([20], 512, seed=6)[0]
    expected = hf_greedy(hf, prompt, 6)
    first = proposer.propose([ProposalRequest("a", prompt, 4)])[0]
    assert first == expected[:4]
    # two kept and a corrected third: the next proposal continues from there
    second = proposer.propose([ProposalRequest("a", prompt + expected[:3], 3)])[0]
    assert second == expected[3:6]


def _full_cache(engine, proposer):
    import dataclasses

    from splitserve.engine.kv_cache import KVCache

    layout = proposer.runner.kv_cache.layout
    return KVCache(dataclasses.replace(layout, num_layers=engine.model_config.num_layers), engine.device)


def test_the_draft_cache_follows_the_engine_requests_and_evicts_the_least_recently_used(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    engine = _engine(tmp_path, SpeculativeConfig(method="self", num_tokens=2, draft_layers=1))
    runner = engine.speculation.proposer.runner
    proposer = ModelProposer("self", runner, 512, 1024)
    proposer._free = proposer._free[-4:]  # 4 blocks of 8 tokens
    prompts = random_prompts([10, 10, 10], 512, seed=8)
    assert proposer.propose([ProposalRequest("a", prompts[0], 2)])[0]
    assert proposer.propose([ProposalRequest("b", prompts[1], 2)])[0]
    assert set(proposer._seqs) == {"a", "b"} and not proposer._free
    # "c" needs 2 blocks: "a", used least recently, gives them up
    assert proposer.propose([ProposalRequest("c", prompts[2], 2)])[0]
    assert set(proposer._seqs) == {"b", "c"}
    # a request that cannot fit even alone gets no proposal, keeps nothing, evicts nothing
    assert proposer.propose([ProposalRequest("d", prompts[2] * 4, 2)]) == [[]]
    assert set(proposer._seqs) == {"b", "c"}
    proposer.forget({"c"})
    assert set(proposer._seqs) == {"c"} and len(proposer._free) == 2


def test_a_draft_step_that_raises_drops_the_batchs_draft_state(tmp_path):
    """A failed draft step leaves no half-written state behind: the next proposal
    catches up from scratch and proposes what it would have."""
    hf = make_hf_checkpoint("llama", tmp_path)
    engine = _engine(tmp_path, SpeculativeConfig(method="self", num_tokens=3, draft_layers=1))
    proposer = engine.speculation.proposer
    proposer.runner.model = EarlyExit(engine.model, engine.model_config.num_layers)
    proposer.runner.kv_cache = _full_cache(engine, proposer)
    prompt = random_prompts([20], 512, seed=9)[0]
    expected = hf_greedy(hf, prompt, 3)
    forward = proposer.runner.forward
    proposer.runner.forward = lambda inputs: 1 / 0
    with pytest.raises(ZeroDivisionError):
        proposer.propose([ProposalRequest("a", prompt, 3)])
    assert not proposer._seqs
    proposer.runner.forward = forward
    assert proposer.propose([ProposalRequest("a", prompt, 3)])[0] == expected


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_self_speculation_copies_the_computed_kv_from_the_target(family, tmp_path):
    """A self-speculation draft's layers are the target's first ones, so its KV of a
    request's computed tokens is read from the target's cache: a first proposal runs
    the last token alone, and proposes what a draft recomputing the whole sequence
    proposes (the recomputing path is the reference)."""
    make_hf_checkpoint(family, tmp_path)
    spec = SpeculativeConfig(method="self", num_tokens=3, draft_layers=1)
    engine = _engine(tmp_path, spec, enable_prefix_caching=False)
    rid = engine.add_request(random_prompts([45], 512, seed=9)[0], SamplingParams(max_tokens=4))
    while engine.requests[rid].seq.num_output_tokens < 2:
        engine.step()
    seq = engine.requests[rid].seq
    assert seq.num_computed_tokens == seq.num_tokens - 1
    copying = engine.speculation.proposer
    assert copying.shared is engine.kv_cache
    recomputing = ModelProposer("self", copying.runner, copying.vocab_size, copying.max_len)
    request = ProposalRequest("probe", seq.token_ids, 3, seq.block_table)
    before = copying.runner.tokens_run
    copied = copying.propose([request])[0]
    assert copying.runner.tokens_run - before == 3  # the last token, then two drafted ones
    layers = copying.runner.kv_cache.layout.num_layers
    bs, n = engine.kv_cache.layout.block_size, seq.num_tokens - 1
    mine = copying._seqs["probe"].blocks
    for p in (0, n // 2, n - 1):  # the draft's cache holds the target's first layers' rows
        theirs = engine.kv_cache.tensor[:layers, :, seq.block_table[p // bs], p % bs]
        assert torch.equal(copying.runner.kv_cache.tensor[:, :, mine[p // bs], p % bs], theirs), p
    copying.forget([])
    assert recomputing.propose([request])[0] == copied
