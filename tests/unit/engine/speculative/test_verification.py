"""Speculative decoding's verification in one engine, against references that do
not speculate: float32 greedy tokens equal transformers' ``generate`` for tiny
random models of every family (dense, MoE, MLA), and seeded sampling, logprobs,
penalties, stop tokens and ``max_tokens`` give what the same engine gives without
it. Random-weight models do not copy their prompts, so n-gram lookup would rarely
be right: here the proposer is a stand-in (``Oracle``) that proposes the reference
continuation with every third token wrong, so every test checks kept drafts,
rejected ones and whole drafts kept, and shows each happened (a step that never
speculated would pass any equality). The n-gram proposer itself is tested with
SmolLM2 copying text (``test_ngram_smollm2``)."""

from __future__ import annotations

import pytest

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

MAX_NEW = 40
NGRAM = SpeculativeConfig(method="ngram", num_tokens=4)


class Oracle:
    """Proposes each request's reference continuation (found by its prompt), with
    every ``wrong_every``-th output position's token changed."""

    name = "ngram"  # stands in for the configured proposer

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], vocab: int, wrong_every: int = 3):
        self.refs = list(zip(prompts, outputs))
        self.vocab, self.wrong_every = vocab, wrong_every

    def propose(self, requests) -> list[list[int]]:
        out = []
        for r in requests:
            prompt, output = next((p, o) for p, o in self.refs if r.token_ids[: len(p)] == p)
            done = len(r.token_ids) - len(prompt)
            draft = output[done : done + r.k]
            out.append(
                [
                    (t + 1) % self.vocab if (done + i) % self.wrong_every == 0 else t
                    for i, t in enumerate(draft)
                ]
            )
        return out

    def forget(self, live) -> None:
        pass


def _prompts(seed: int) -> list[list[int]]:
    return random_prompts([5, 12, 31], 512, seed=seed)


def _engine(directory, speculative=None, **overrides) -> Engine:
    cfg = dict(model=str(directory), dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    return Engine(EngineConfig(**(cfg | overrides), speculative=speculative))


def _speculating(directory, prompts, outputs, **overrides) -> Engine:
    engine = _engine(directory, NGRAM, **overrides)
    engine.speculation.proposer = Oracle(prompts, outputs, 512)
    return engine


def _assert_speculated(engine: Engine) -> None:
    spec = engine.stats().speculation
    assert spec.accepted_tokens > 0, spec  # drafts were kept ...
    assert spec.proposed_tokens > spec.accepted_tokens, spec  # ... and rejected
    assert spec.mean_accepted_length > 1.5, spec


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "deepseek_v3"])
def test_greedy_with_ngram_speculation_equals_transformers(family, tmp_path):
    hf = make_hf_checkpoint(family, tmp_path)
    prompts = _prompts(seed=3)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    engine = _speculating(tmp_path, prompts, expected)
    out = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in out] == expected
    _assert_speculated(engine)
    assert engine.block_manager.num_used_blocks == 0  # no block left behind by a rejected draft


@pytest.mark.parametrize("family, backend", [("llama", "cpu"), ("llama", "sdpa"), ("deepseek_v3", "auto")])
def test_verification_rows_spread_as_decode_spans_equal_transformers(family, backend, tmp_path):
    """``spread_drafts`` (on by itself with CUDA graphs): a draft's rows run as one-token
    decode spans, row j over the prefix through it, so every step with drafts has a
    pure-decode shape. The tokens are transformers' and every such step was packed so."""
    hf = make_hf_checkpoint(family, tmp_path)
    prompts = _prompts(seed=8)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    engine = _speculating(tmp_path, prompts, expected, attention_backend=backend)
    engine.runner.spread_drafts = True
    runner, shapes, drafts_only = engine.runner, [], [False]
    execute, run = runner.execute, runner.run

    def executing(scheduled, on_layer=None):  # note steps of decodes and drafts only
        drafts_only[0] = any(s.draft for s in scheduled) and all(
            s.num_new_tokens == 1 or s.draft for s in scheduled
        )
        return execute(scheduled, on_layer)

    def running(inputs, on_layer=None):
        if drafts_only[0]:
            shapes.append((len(inputs.input_ids), inputs.num_decodes, len(inputs.spans)))
        return run(inputs, on_layer)

    runner.execute, runner.run = executing, running
    out = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in out] == expected
    _assert_speculated(engine)
    assert shapes and all(tokens == decodes == spans for tokens, decodes, spans in shapes), shapes


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_hf_checkpoint("llama", directory)
    return directory


def _both(directory, prompts, params, **overrides):
    """(without speculation, with it, the speculating engine) for the same requests."""
    plain = _engine(directory, None, **overrides).generate(prompts, params)
    engine = _speculating(directory, prompts, [o.token_ids for o in plain], **overrides)
    return plain, engine.generate(prompts, params), engine


def test_seeded_sampling_gives_the_same_tokens_with_speculation(llama):
    prompts = _prompts(seed=4)
    params = [
        SamplingParams(max_tokens=MAX_NEW, temperature=0.7, top_k=20, seed=s, ignore_eos=True)
        for s in (1, 2, 3)
    ]
    plain, spec, engine = _both(llama, prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    _assert_speculated(engine)


def test_logprobs_and_penalties_are_those_of_decoding_without_speculation(llama):
    prompts = _prompts(seed=5)
    params = SamplingParams(
        max_tokens=MAX_NEW,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
        presence_penalty=0.3,
        repetition_penalty=1.1,
    )
    plain, spec, engine = _both(llama, prompts, params)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in b.top_logprobs] == [
            [t for t, _ in top] for top in a.top_logprobs
        ]
    _assert_speculated(engine)


def test_max_tokens_and_stop_tokens_end_inside_a_draft(llama):
    prompts = _prompts(seed=6)
    plain = _engine(llama).generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    # stop at the 9th token of each output; max_tokens 7 for the last
    params = [SamplingParams(max_tokens=MAX_NEW, stop_token_ids=(o.token_ids[8],)) for o in plain[:2]]
    params.append(SamplingParams(max_tokens=7, ignore_eos=True))
    engine = _speculating(llama, prompts, [o.token_ids for o in plain])
    out = engine.generate(prompts, params)
    _assert_speculated(engine)
    for o, p, ref in zip(out, params, plain):
        stop = ref.token_ids.index(p.stop_token_ids[0]) + 1 if p.stop_token_ids else p.max_tokens
        assert o.token_ids == ref.token_ids[:stop]
    assert engine.block_manager.num_used_blocks == 0


def test_a_request_that_opts_out_is_never_speculated(llama):
    prompts = _prompts(seed=7)
    engine = _speculating(llama, prompts, [p[:1] * MAX_NEW for p in prompts])
    engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, speculate=False))
    assert engine.stats().speculation.proposed_tokens == 0


def test_a_failing_proposer_costs_speed_not_tokens(llama):
    prompts = _prompts(seed=8)
    expected = [
        o.token_ids
        for o in _engine(llama).generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    ]
    engine = _speculating(llama, prompts, expected)

    def broken(requests):
        raise RuntimeError("proposer down")

    engine.speculation.proposer.propose = broken
    out = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in out] == expected
    assert engine.stats().speculation.proposer_errors > 0
    assert engine.stats().speculation.proposed_tokens == 0


def test_a_cache_too_small_for_the_batch_preempts_and_keeps_the_tokens(llama):
    prompts = _prompts(seed=9)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    # 14 blocks of 8: less than the batch needs at its longest (22), room for any one sequence and its draft
    plain, spec, engine = _both(llama, prompts, params, num_kv_blocks=14, enable_prefix_caching=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    _assert_speculated(engine)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0
