"""The MoE layer's parts against transformers' own modules (the independent
reference): routing (``route``) against each family's router, and the grouped
expert kernel (``grouped_experts``) against transformers' per-expert loop, with
ordinary and skewed routing (every token to one expert; experts that get none),
and split across "ranks" by expert range (what expert parallelism computes)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.moe import grouped_experts, route
from tests.conftest import tiny_hf_config

T, H = 37, 64


def _hf_router(kind: str, hf):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cls = {
        "mixtral": MixtralTopKRouter,
        "qwen2_moe": Qwen2MoeTopKRouter,
        "qwen3_moe": Qwen3MoeTopKRouter,
        "deepseek_v3": DeepseekV3TopkRouter,
    }[kind]
    router = cls(hf)
    torch.nn.init.normal_(router.weight, std=0.3)
    if hasattr(router, "e_score_correction_bias"):
        router.e_score_correction_bias.uniform_(0, 0.5)
    return router


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("skewed", [False, True])
def test_route_equals_the_family_router(kind, skewed):
    torch.manual_seed(0)
    hf = tiny_hf_config(kind)
    moe = ModelConfig.from_hf(hf).moe
    router = _hf_router(kind, hf)
    x = torch.randn(T, H)
    if skewed:  # every token the same direction: one expert (or group) wins everywhere
        x = x * 0.01 + router.weight[1] * 10
    with torch.no_grad():
        _, want_w, want_ids = router(x)
        bias = getattr(router, "e_score_correction_bias", None)
        weights, ids = route(torch.nn.functional.linear(x, router.weight).float(), bias, moe)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.float().gather(1, want_order))
    if skewed:
        assert (ids == ids[0]).all() or kind == "deepseek_v3"


def _hf_experts(num_experts: int, inter: int):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    hf = tiny_hf_config("mixtral")
    hf.num_local_experts, hf.intermediate_size = num_experts, inter
    experts = MixtralExperts(hf)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    return experts


ROUTINGS = {
    "random": lambda g: torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)]),
    "one expert": lambda g: torch.stack([torch.tensor([3, 5 if i % 2 else 6]) for i in range(T)]),
    "all to expert 3": lambda g: torch.full((T, 1), 3),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_grouped_experts_equal_the_per_expert_loop(routing):
    g = torch.Generator().manual_seed(1)
    experts = _hf_experts(8, 32)
    x = torch.randn(T, H, generator=g)
    ids = ROUTINGS[routing](g)
    weights = torch.rand(ids.shape, generator=g)
    with torch.no_grad():
        want = experts(x, ids, weights)
        got = grouped_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
        # the experts split over 2 and 4 "ranks" by range: the partial sums add up to the whole
        for parts in (2, 4):
            per = 8 // parts
            split = sum(
                grouped_experts(
                    x,
                    experts.gate_up_proj[r * per : (r + 1) * per],
                    experts.down_proj[r * per : (r + 1) * per],
                    weights,
                    ids,
                    first_expert=r * per,
                )
                for r in range(parts)
            )
            torch.testing.assert_close(split, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if routing != "random":  # the skewed routings leave experts without a token
        assert set(range(8)) - set(ids.flatten().tolist())
