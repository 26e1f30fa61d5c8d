"""The FP8 Triton kernels of ``splitserve.engine.kernels.fp8`` against torch, run by
Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py on
machines without CUDA): activations quantized per token and group, the norm and
SiLU·up emitting them, the block-scaled GEMM, and a model's layers wired to pass
FP8 activations from the norms to their linears. tests/gpu runs them compiled.

Values and scales are compared exactly: interpreted, the kernels round to e4m3's
grid before converting (``kernels.fp8._e4m3``), half to even as torch does."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"),
]


def grouped_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's per-row quantization (``quant.quantize_fp8``) of each group of columns."""
    from splitserve.engine.model.quant import quantize_fp8

    rows, dim = x.shape
    q, scale = quantize_fp8(x.reshape(rows, dim // group, group))
    return q.reshape(rows, dim), scale.reshape(rows, dim // group)


def assert_same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, dim = q.shape
    groups = scale.shape[1]
    return (q.float().view(rows, groups, dim // groups) * scale[:, :, None]).view(rows, dim)


@pytest.mark.parametrize("rows, dim, group", [(5, 96, 96), (3, 512, 128), (1, 576, 64), (0, 256, 128)])
def test_groups_quantize_as_torch_does(rows, dim, group):
    from splitserve.engine.kernels import fp8
    from splitserve.engine.model.quant import _EPS, FP8_MAX

    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(dim)) * 3
    if rows > 1:
        x[1, :group] = 0  # an all-zero group: the floor scale, no NaN
    assert_same_fp8(fp8.quantize_fp8_groups(x, group, FP8_MAX, _EPS), grouped_reference(x, group))


def test_a_group_that_does_not_fit_is_refused():
    from splitserve.engine.kernels import fp8

    with pytest.raises(ValueError, match="power of two"):
        fp8.quantize_fp8_groups(torch.zeros(2, 96), 48, 448.0, 1e-12)
    with pytest.raises(ValueError, match="do not split"):
        fp8.quantize_fp8_groups(torch.zeros(2, 96), 64, 448.0, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim, group", [(96, 96), (256, 64)])
def test_norm_emits_fp8_as_the_norm_then_the_quantizer(dtype, dim, group):
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.quant import _EPS, FP8_MAX

    g = torch.Generator().manual_seed(dim)
    weight = torch.randn(dim, generator=g).to(dtype)
    x = torch.randn(6, dim, generator=g).to(dtype)
    delta = torch.randn(6, dim, generator=g).to(dtype)
    x_ref = x.clone()
    normed = cuda.add_rms_norm(x_ref, delta, weight, 1e-5)
    got = cuda.add_rms_norm_fp8(x, delta, weight, 1e-5, group, FP8_MAX, _EPS)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)  # the residual stream, updated in place
    assert_same_fp8(got, grouped_reference(normed.float(), group))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter, group", [(96, 96), (2048, 2048), (384, 128)])
def test_silu_mul_emits_fp8_as_silu_mul_then_the_quantizer(dtype, inter, group):
    """(2048: a row wider than one chunk, quantized per token in two passes.)"""
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.quant import _EPS, FP8_MAX

    gate_up = (torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 2).to(dtype)
    want = grouped_reference(cuda.silu_mul(gate_up).float(), group)
    assert_same_fp8(cuda.silu_mul_fp8(gate_up, group, FP8_MAX, _EPS), want)


@pytest.mark.parametrize("rows", [0, 1, 7, 40, 130])
@pytest.mark.parametrize("block", [16, 128])
def test_block_fp8_mm_matches_the_dequantized_product(rows, block):
    """Ragged row counts (empty, inside one tile, across tiles), 70 output rows (not a
    multiple of any tile), four blocks along K, scales spread over two decades."""
    from splitserve.engine.kernels import fp8
    from splitserve.engine.model.quant import _EPS, FP8_MAX

    g = torch.Generator().manual_seed(rows + block)
    k = 4 * block
    w = torch.randn(70, k, generator=g) * torch.logspace(-1, 1, 4).repeat_interleave(block)
    w_q, w_scale = grouped_reference(w, block)
    x_q, x_scale = fp8.quantize_fp8_groups(torch.randn(rows, k, generator=g), block, FP8_MAX, _EPS)
    got = fp8.block_fp8_mm(x_q, x_scale, w_q, w_scale, torch.float32)
    want = F.linear(dequantized(x_q, x_scale), dequantized(w_q, w_scale))
    assert got.shape == (rows, 70)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="do not match"):
        fp8.block_fp8_mm(x_q, x_scale, w_q[:, :-1], w_scale, torch.float32)


def block_fp8_linear(linear: torch.nn.Linear, block: int):
    """A checkpoint FP8 linear (``Fp8CheckpointLinear``) of ``linear``'s weight, one
    scale per row and ``block`` columns."""
    from splitserve.engine.model.quant import Fp8CheckpointLinear

    out, k = linear.weight.shape
    layer = Fp8CheckpointLinear(k, out, k // block, bias=False)
    q, scale = grouped_reference(linear.weight.detach(), block)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(scale)
    layer.ready()
    return layer


def test_a_models_norms_hand_fp8_to_block_linears(monkeypatch):
    """With the Triton set, each norm and SiLU·up before a block-FP8 linear emits FP8 in
    the linear's grouping: the same output bits as quantizing inside the linear, close
    to the float model's."""
    from splitserve.engine import kernels
    from splitserve.engine.model import quant
    from splitserve.engine.model.config import ModelConfig
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.model.replace import replace_children
    from tests.conftest import tiny_hf_config

    monkeypatch.setattr(quant, "fp8_gemm_supported", lambda device: True)  # the kernels run interpreted
    cfg = ModelConfig.from_hf(tiny_hf_config("llama"))
    model = load_model(cfg, torch.float32, torch.device("cpu"), 64, None)  # plain nn.Linear layers
    layer = model.layers[0]
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(1))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        qkv = layer.self_attn.qkv_proj(layer.input_layernorm(x.clone()))
        return qkv, layer.mlp(layer.post_attention_layernorm(x.clone()))

    float_out = run()
    replace_children(model.layers, torch.nn.Linear, lambda lin: block_fp8_linear(lin, 32))
    cuda = kernels.load_cuda()
    calls = []
    spied = type("Spy", (), {})()
    for name in ("add_rms_norm", "rope_and_cache", "silu_mul", "fused_experts", "silu_mul_fp8"):
        setattr(spied, name, getattr(cuda, name))
    spied.add_rms_norm_fp8 = lambda *a: calls.append(a[4]) or cuda.add_rms_norm_fp8(*a)
    model.use_kernels(spied)
    assert (layer.input_layernorm.fp8_group, layer.post_attention_layernorm.fp8_group) == (32, 32)
    assert layer.mlp.fp8_group == 32 and model.norm.fp8_group is None
    fused = run()
    assert calls == [32, 32]
    for m in model.modules():  # the same linears quantizing their own input
        if hasattr(m, "fp8_group"):
            m.fp8_group = None
    unfused = run()
    for f, u, ref in zip(fused, unfused, float_out):
        assert torch.equal(f, u)
        assert (f - ref).norm() / ref.norm() < 0.1  # FP8 weights and activations, two GEMMs deep
