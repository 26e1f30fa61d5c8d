"""The Triton grouped-experts kernel (``kernels.triton_moe``) against the torch
grouped kernel (itself checked against transformers' expert loop in
``model/test_moe.py``), run by Triton's CPU interpreter (``TRITON_INTERPRET=1``, set
by tests/conftest.py on machines without CUDA): random routing, every pair on one
expert, experts that get none, runs that are not multiples of the block, and a
SparseMoE layer with the kernel set on (and expert ranges, as under EP)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from splitserve.engine.model.moe import expert_rows, grouped_experts

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"),
]

E, H, INTER, K = 6, 48, 40, 2  # widths that are not powers of two


def _case(t: int, routing: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    down = torch.randn(E, H, INTER, generator=g) * 0.2
    weights = torch.rand(t, K, generator=g)
    if routing == "one_expert":
        ids = torch.full((t, K), 4)
    elif routing == "two_experts":  # the other four get none
        ids = torch.stack([torch.tensor([1, 3])[torch.randperm(2, generator=g)] for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize(
    "t, routing", [(1, "random"), (37, "random"), (23, "one_expert"), (19, "two_experts")]
)
def test_triton_grouped_experts_equal_the_torch_kernel(t, routing):
    from splitserve.engine.kernels.triton_moe import grouped_experts_gemm

    x, gate_up, down, weights, ids = _case(t, routing)
    want = grouped_experts(x, gate_up, down, weights, ids)
    got = grouped_experts(x, gate_up, down, weights, ids, kernel=grouped_experts_gemm)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # an expert range (what one expert-parallel rank holds), and rows sent to it
    got = grouped_experts(
        x, gate_up[2:5], down[2:5], weights, ids, first_expert=2, kernel=grouped_experts_gemm
    )
    torch.testing.assert_close(got, grouped_experts(x, gate_up[2:5], down[2:5], weights, ids, first_expert=2))
    local = ids[:, 0] % 3
    torch.testing.assert_close(
        expert_rows(x, local, gate_up[:3], down[:3], grouped_experts_gemm),
        expert_rows(x, local, gate_up[:3], down[:3]),
        rtol=1e-4,
        atol=1e-4,
    )


def test_a_moe_model_with_the_triton_set_computes_what_torch_does():
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.config import ModelConfig
    from splitserve.engine.model.loader import load_model
    from tests.conftest import tiny_hf_config

    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3_moe"))
    model = load_model(cfg, torch.float32, torch.device("cpu"), 64, None, seed=3)
    x = torch.randn(29, cfg.hidden_size)
    layer = model.layers[1].mlp  # layer 0 is dense
    want = layer(x)
    layer.grouped_kernel = cuda.grouped_experts_gemm
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
