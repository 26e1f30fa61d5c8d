"""The Triton kernels of ``splitserve.engine.kernels.cuda`` (fused add+RMSNorm,
weight-only int8 matmul) against torch, run by Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py on machines without CUDA);
tests/gpu runs them compiled, inside the engine."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_the_torch_norm(dtype, with_delta):
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.llama import RMSNorm

    g = torch.Generator().manual_seed(0)
    dim = 96  # not a power of two: the kernel masks its padded lanes
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    norm = norm.to(dtype)
    x = torch.randn(5, dim, generator=g).to(dtype)
    delta = torch.randn(5, dim, generator=g).to(dtype) if with_delta else None
    x_ref = x.clone()
    expected = norm(x_ref, None if delta is None else delta.clone())
    got = cuda.add_rms_norm(x, delta, norm.weight.detach(), 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(x, x_ref, rtol=0, atol=0)  # the residual stream, updated in place
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # the interpreter rounds to bf16 by truncation, and 1/sqrt vs rsqrt: one ulp at most
        torch.testing.assert_close(x, x_ref)
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("rows", [1, 7, 20, 40, 100, 130])
def test_int8_weight_mm_matches_the_dequantized_product(rows):
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.quant import quantize_int8

    g = torch.Generator().manual_seed(rows)
    n, k = 70, 200  # neither a multiple of its tile
    w_q, scale = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g)
    expected = (x @ w_q.float().t()) * scale
    got = cuda.int8_weight_mm(x, w_q, scale)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    if rows <= 16:  # the other weight-tile orientation gpu_bench --sweep may choose
        other = cuda.int8_weight_mm_tiled(x, w_q, scale, 16, 32, 64, 2, 4, w_rows=True)
        torch.testing.assert_close(other, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (6, 3, 8)])
def test_rope_and_cache_matches_rotary_and_index_copy(heads, kv_heads, dim):
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.rope import apply_rotary

    g = torch.Generator().manual_seed(heads)
    T, slots = 5, 40
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.rand(T, 1, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [T, 1, D]
    slot_mapping = torch.randperm(slots, generator=g)[:T]
    k_cache, v_cache = torch.zeros(2, slots, kv_heads, dim)
    q, k, v = cuda.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads)

    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref = apply_rotary(q_ref.reshape(T, heads, dim), cos, sin)
    k_ref = apply_rotary(k_ref.reshape(T, kv_heads, dim), cos, sin)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_ref.reshape(T, kv_heads, dim), rtol=0, atol=0)
    torch.testing.assert_close(k_cache[slot_mapping], k_ref)
    torch.testing.assert_close(v_cache[slot_mapping], v_ref.reshape(T, kv_heads, dim), rtol=0, atol=0)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (8, 1, 8)])
def test_rope_and_cache_writes_an_fp8_cache_as_kv_quant_does(heads, kv_heads, dim):
    """An FP8 (e4m3) cache: the kernel writes ``kv_quant.quantize`` of the k and v it
    returns, byte for byte, with each head's own scale (values past the range saturate);
    q and k are as the bf16 path's."""
    from splitserve.engine import kv_quant
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.rope import apply_rotary

    g = torch.Generator().manual_seed(dim)
    T, slots = 6, 32
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, generator=g) * 3
    qkv[0, heads * dim] = 5000.0  # past e4m3's range at its head's scale: saturates
    angles = torch.rand(T, 1, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slot_mapping = torch.randperm(slots, generator=g)[:T]
    scales = torch.exp2(torch.randint(-4, 2, (2, kv_heads), generator=g).float())
    k_cache, v_cache = torch.zeros(2, slots, kv_heads, dim).to(kv_quant.FP8)
    q, k, v = cuda.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads, scales)

    k_ref = apply_rotary(qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(T, kv_heads, dim), cos, sin)
    torch.testing.assert_close(k, k_ref)
    raw_k, raw_v = kv_quant.as_bytes(k_cache), kv_quant.as_bytes(v_cache)
    assert torch.equal(raw_k[slot_mapping], kv_quant.as_bytes(kv_quant.quantize(k, scales[0])))
    assert torch.equal(raw_v[slot_mapping], kv_quant.as_bytes(kv_quant.quantize(v, scales[1])))
    assert k_cache[slot_mapping].float().abs().max() == kv_quant.FP8_MAX  # the saturated value
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert not raw_k[untouched].any() and not raw_v[untouched].any()
    with pytest.raises(ValueError, match="kv_scales"):
        cuda.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads)


def test_silu_mul_matches_torch():
    from splitserve.engine.kernels import cuda

    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 2 * 1500, generator=g) * 4  # more than one column block
    gate, up = gate_up.split(1500, dim=-1)
    torch.testing.assert_close(cuda.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
