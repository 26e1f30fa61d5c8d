"""Sampler: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.engine.sampler import Sampler, SampleRequest
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import SamplingParams


def rows(params: SamplingParams, n: int = 1, index: int = 0) -> list[SampleRequest]:
    return [SampleRequest(params, index)] * n


def test_greedy_is_argmax():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, rows(SamplingParams(), 4))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_1_is_greedy_even_when_sampling():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, rows(SamplingParams(temperature=5.0, top_k=1), 8))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_draws_only_from_the_k_best():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2)).repeat(400, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    out = Sampler(seed=3)(logits, rows(SamplingParams(temperature=10.0, top_k=3), 400))
    assert set(out.token_ids) == top3


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(500, 1)
    out = Sampler(seed=4)(logits, rows(SamplingParams(temperature=1.0, top_p=0.75), 500))
    assert set(out.token_ids) == {0, 1}  # 0.5 < 0.75 so token 1 is needed; 0.8 >= 0.75 stops


def _nucleus_by_full_sort(logits: torch.Tensor, p: float) -> torch.Tensor:
    """The reference: every token sorted; dropped once the mass before it reaches p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= p
    drop[:, 0] = False
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, ~drop)


@pytest.mark.parametrize("p", [0.5, 0.9, 0.999])
def test_top_p_over_a_large_vocabulary_keeps_the_full_sorts_nucleus(p):
    """Over 5,000 tokens, rows peaked, flat and between, in a batch with a row that does
    not use top_p: each keeps exactly the nucleus an argsort finds (no ties here)."""
    from splitserve.engine.sampler import _top_p

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 5000, generator=g) * torch.tensor([[8.0], [0.1], [2.5], [1.0]])
    got = _top_p(logits, [0, 1, 2], [p, p, p]) > float("-inf")
    assert torch.equal(got[:3], _nucleus_by_full_sort(logits[:3], p))
    assert got[3].all()  # not a top_p row: untouched


def test_tokens_tied_at_the_nucleus_edge_stay_together():
    """A token stays when the tokens likelier than it hold less than top_p: tokens tied
    at the edge all stay (an argsort would keep an arbitrary one of them)."""
    from splitserve.engine.sampler import _top_p

    logits = torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0]]).log()
    got = _top_p(logits, [0], [0.5]) > float("-inf")
    assert got[0].tolist() == [True, True, True, True, False]
    got = _top_p(logits, [0], [0.3]) > float("-inf")
    assert got[0].tolist() == [True, False, False, False, False]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(6000, 1)
    out = Sampler(seed=5)(logits, rows(SamplingParams(temperature=1.0), 6000))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 6000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_reproduce_regardless_of_batch_and_global_state():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(6))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(seed=0)(logits, [SampleRequest(p, 5)]).token_ids[0]
    other = torch.randn(3, 1000)
    batch = torch.cat([other, logits])
    mixed = [SampleRequest(SamplingParams(temperature=1.0), 0)] * 3 + [SampleRequest(p, 5)]
    in_batch = Sampler(seed=99)(batch, mixed).token_ids[3]
    assert alone == in_batch
    draws = {Sampler()(logits, [SampleRequest(p, i)]).token_ids[0] for i in range(30)}
    assert len(draws) > 1  # the index advances the noise


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = Sampler()(logits, rows(SamplingParams(logprobs=True)))
    assert out.token_ids == [0]
    assert math.isclose(out.logprobs[0], torch.log_softmax(logits, -1)[0, 0].item(), rel_tol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"seed": -3},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
    ],
)
def test_bad_sampling_params_raise_invalid_request(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


# ---- logits processing, against transformers' own processors ---------------------------
VOCAB = 64


def _hf_processed(
    logits: torch.Tensor, params: SamplingParams, token_ids: list[int], n_prompt: int, eos: int
):
    """One row processed by transformers' logits processors (and OpenAI's documented
    formula for frequency / presence penalties, which transformers does not have)."""
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    ids = torch.tensor([token_ids])
    scores = logits.clone()[None]
    if params.allowed_token_ids is not None:
        allowed = torch.full_like(scores, float("-inf"))
        allowed[0, list(params.allowed_token_ids)] = 0
        scores = scores + allowed
    if params.min_tokens:
        held = [eos, *params.stop_token_ids]
        scores = MinNewTokensLengthLogitsProcessor(n_prompt, params.min_tokens, held)(ids, scores)
    if params.logit_bias:
        scores = SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias})(ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    out = scores[0].clone()
    for tok in set(token_ids[n_prompt:]):
        count = token_ids[n_prompt:].count(tok)
        out[tok] -= count * params.frequency_penalty + params.presence_penalty
    return out


MIXED = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6, temperature=0.8, seed=1),
    SamplingParams(frequency_penalty=1.5, presence_penalty=-0.5),
    SamplingParams(logit_bias={3: 5.0, 9: -100.0, 11: 2.5}),
    SamplingParams(min_tokens=6, stop_token_ids=[4, 5]),
    SamplingParams(min_tokens=2, stop_token_ids=[4]),  # already past its minimum
    SamplingParams(allowed_token_ids=[1, 7, 8, 30]),
    SamplingParams(),  # nothing to process: left as it is
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={0: 1.0}, min_tokens=9),
]


def test_processing_equals_transformers_per_row_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(len(MIXED), VOCAB, generator=gen) * 3
    eos = 2
    histories = [torch.randint(0, VOCAB, (12 + i,), generator=gen).tolist() for i in range(len(MIXED))]
    rows = [SampleRequest(p, len(h) - 8, h, 8) for p, h in zip(MIXED, histories)]
    got = Sampler(eos_token_ids=[eos]).process(logits.clone(), rows)
    for i, (p, h) in enumerate(zip(MIXED, histories)):
        want = _hf_processed(logits[i], p, h, 8, eos)
        assert torch.allclose(got[i], want, atol=1e-6), (i, p)
    assert torch.equal(got[7], logits[7])


def test_greedy_rows_pick_the_argmax_of_their_processed_logits():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(1, VOCAB, generator=gen).repeat(3, 1)
    top = int(logits[0].argmax())
    history = [top] * 5
    params = [
        SamplingParams(repetition_penalty=50.0),
        SamplingParams(logit_bias={top: -100.0}),
        SamplingParams(),
    ]
    rows = [SampleRequest(p, 3, history, 2) for p in params]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] != top and out.token_ids[1] != top and out.token_ids[2] == top
    only = Sampler()(logits, [SampleRequest(SamplingParams(allowed_token_ids=[5, 6]), 0, [1], 1)])
    assert only.token_ids[0] == 5 + int(logits[0, 6] > logits[0, 5])


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, 3.0]])
    p = SamplingParams(temperature=1.0, min_p=0.5)
    draws = {Sampler(seed=s)(logits, [SampleRequest(p, 0)]).token_ids[0] for s in range(200)}
    assert draws == {0, 1}  # e^3 / e^4 = 0.37 < 0.5: token 4 is dropped, as transformers' MinPLogitsWarper


def test_min_p_equals_transformers_warper():
    from transformers import MinPLogitsWarper

    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    kept_hf = torch.isfinite(MinPLogitsWarper(0.2)(None, logits.clone()))[0]
    p = SamplingParams(temperature=1.0, min_p=0.2)
    draws = {Sampler(seed=s)(logits, [SampleRequest(p, 0)]).token_ids[0] for s in range(400)}
    assert draws <= set(kept_hf.nonzero().flatten().tolist()) and len(draws) > 1


@pytest.mark.parametrize(
    "bad, needle",
    [
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(frequency_penalty=3.0), "frequency_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(logit_bias={1: 200.0}), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
    ],
)
def test_out_of_range_processing_parameters_are_refused(bad, needle):
    with pytest.raises(InvalidRequest, match=needle):
        SamplingParams(**bad)


def test_top_logprobs_are_the_raw_distributions_best():
    """Per row: the chosen token's logprob and the N best of the unprocessed distribution,
    whatever the row's own processing and sampling (and None for rows that ask nothing)."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(10))
    params = [
        SamplingParams(logprobs=True, top_logprobs=5, repetition_penalty=2.0),
        SamplingParams(logprobs=True, top_logprobs=2, temperature=1.0, seed=3),
        SamplingParams(),
    ]
    out = Sampler()(logits, [SampleRequest(p, 0, [1, 2], 2) for p in params])
    ref = torch.log_softmax(logits, dim=-1)
    for i, n in ((0, 5), (1, 2)):
        best = ref[i].topk(n)
        assert [t for t, _ in out.top_logprobs[i]] == best.indices.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(best.values.tolist(), abs=1e-6)
        assert out.logprobs[i] == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-6)
    assert out.top_logprobs[2] is None and out.logprobs[2] is None
    with pytest.raises(InvalidRequest, match="top_logprobs needs logprobs"):
        SamplingParams(top_logprobs=3)
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=21)


def test_bad_words_ids_equal_transformers_no_bad_words_processor():
    """Over output tokens (transformers' processor sees only them here: no prompt)."""
    from transformers import NoBadWordsLogitsProcessor

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, VOCAB, generator=gen)
    histories = [[4, 9, 13], [4, 9], [13, 13, 4]]
    bad = ((13,), (9, 21), (4, 9, 30), (13, 4, 40))
    params = SamplingParams(bad_words_ids=bad)
    got = Sampler().process(logits.clone(), [SampleRequest(params, len(h), h, 0) for h in histories])
    for i, h in enumerate(histories):
        want = NoBadWordsLogitsProcessor([list(w) for w in bad])(torch.tensor([h]), logits[i : i + 1].clone())
        assert torch.equal(got[i], want[0]), i
    assert torch.isinf(got[1, 30]) and not torch.isinf(got[0, 30])  # (4, 9, 30) only after 4, 9


# ---- nothing unsampleable gets in, and nothing the sampler does makes a token up ------------
@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_field_refuses_nan_and_infinities(field, value):
    with pytest.raises(InvalidRequest, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": 1e308}, "temperature must be in"),
        ({"temperature": 100.01}, "temperature must be in"),
        ({"top_k": 10**30}, "top_k must be an integer in"),
        ({"seed": 2**64}, "seed must be an integer in"),
        ({"logit_bias": {1: math.nan}}, "logit_bias maps"),
        ({"logit_bias": {1: 10**400}}, "logit_bias maps"),
    ],
)
def test_extreme_values_are_refused_with_a_sentence(kwargs, needle):
    with pytest.raises(InvalidRequest, match=needle):
        SamplingParams(**kwargs)


def test_the_smallest_temperature_top_p_and_largest_top_k_still_sample_the_best_token():
    """A temperature that is 0 in float32 (divided by 0.01 instead), a top_p below float32's
    smallest value (the best token always stays) and a top_k past the vocabulary (every
    token) draw from real tokens: the argmax, for the first two."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(9))
    params = [
        SamplingParams(temperature=5e-324, seed=1),
        SamplingParams(temperature=1.0, top_p=5e-324, seed=2),
        SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=3),
    ]
    out = Sampler()(logits, [SampleRequest(p, 0, [1], 1) for p in params])
    assert out.failed == {}
    assert out.token_ids[:2] == logits[:2].argmax(-1).tolist()
    assert 0 <= out.token_ids[2] < 50


def test_a_row_left_with_no_token_fails_alone_and_the_others_keep_their_tokens():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(10))
    fine = SamplingParams(temperature=0.7, seed=5)
    # every allowed token banned as a bad word: nothing is left
    empty = SamplingParams(temperature=0.7, allowed_token_ids=[3], bad_words_ids=[[3]])
    greedy = SampleRequest(SamplingParams(), 0)
    rows = [SampleRequest(fine, 0, [1], 1), SampleRequest(empty, 0, [1], 1), greedy]
    out = Sampler()(logits, rows)
    alone = Sampler()(logits[[0]], rows[:1]).token_ids[0]
    assert set(out.failed) == {1} and "exclude every token" in str(out.failed[1])
    assert out.token_ids == [alone, -1, int(logits[2].argmax())]


def test_a_row_whose_sampling_raises_fails_alone():
    """A row that raises while the batch is sampled (here a logit bias naming a token past
    this vocabulary) is found by sampling row by row; the others' tokens stand."""
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(11))
    bad = SamplingParams(temperature=1.0, logit_bias={50: 1.0})  # the validator would refuse it
    greedy = SampleRequest(SamplingParams(), 0)
    rows = [greedy, SampleRequest(bad, 0, [1], 1), greedy]
    out = Sampler()(logits, rows)
    assert set(out.failed) == {1} and out.failed[1].kind == "sampling"
    assert [out.token_ids[0], out.token_ids[2]] == logits[[0, 2]].argmax(-1).tolist()
