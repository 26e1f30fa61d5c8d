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
