"""FP8 and int8 linears: the kernels against their exact formulas, then whole
quantized models against the unquantized float32 reference.

The measure for models: logits at every position of a prompt set, teacher-forced
(same prefix for both models): cosine similarity to the reference logits, and
top-1 agreement (the greedy token the model would pick at that position).
Thresholds (held here; measured values, by ``python -m splitserve.bench.quant_accuracy``,
in docs/gpu.md):

| model | quantization | mean cosine | top-1 agreement |
|---|---|---|---|
| tiny random Llama | int8 | >= 0.995 | >= 0.90 |
| tiny random Llama | fp8 | >= 0.95 | >= 0.60 |
| SmolLM2-135M | int8 | >= 0.99 | >= 0.90 |
| SmolLM2-135M | fp8 | >= 0.95 | >= 0.65 |
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from splitserve.bench.quant_accuracy import QUESTIONS, closeness
from splitserve.engine.engine import Engine
from splitserve.engine.model.quant import (
    FP8_MAX,
    Fp8Linear,
    Int8Linear,
    quantize_fp8,
    quantize_int8,
    quantize_linears,
)
from splitserve.wire.config import EngineConfig
from tests.conftest import make_hf_checkpoint, random_prompts


def test_fp8_quantization_keeps_three_mantissa_bits():
    w = torch.randn(64, 256) * torch.logspace(-2, 2, 64)[:, None]  # rows of very different scale
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    assert q.float().abs().amax(dim=1).eq(FP8_MAX).all()  # each row uses the full range
    back = q.float() * scale
    normal = w.abs() >= scale * 2**-6  # e4m3's normal range: relative error <= 2^-4
    assert ((back - w).abs() <= w.abs() * 2**-4 + 1e-12)[normal].all()


def test_int8_quantization_error_is_half_a_step():
    w = torch.randn(32, 128)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_fp8_scaled_mm_matches_the_dequantizing_fallback():
    """The GPU path's exact ``torch._scaled_mm`` call (it runs on CPU too) against the
    fallback the CPU uses: the same FP8 product, up to accumulation order."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True)
    layer = Fp8Linear(lin)
    x = torch.randn(10, 256)
    x_q, x_scale = quantize_fp8(x)
    fallback = layer.dequantized_matmul(x_q, x_scale)
    mm = torch._scaled_mm(
        x_q, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale, out_dtype=torch.float32
    )
    torch.testing.assert_close(mm, fallback, rtol=1e-5, atol=1e-5)
    assert not layer.use_scaled_mm  # CPU: the fallback is what forward runs
    torch.testing.assert_close(layer(x), fallback + lin.bias, rtol=0, atol=0)
    # And it approximates the float layer: FP8 keeps ~2 significant digits.
    ref = lin(x)
    assert (layer(x) - ref).norm() / ref.norm() < 0.06


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_dequantized_weights(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=False).to(dtype)
    layer = Int8Linear(lin)
    x = torch.randn(5, 128, dtype=dtype)
    expected = (x.float() @ layer.weight.float().t()) * layer.scale.float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(layer(x).float(), expected, rtol=tol, atol=tol)


def test_only_decoder_linears_are_quantized(tmp_path):
    engine = Engine(
        EngineConfig(model=_tiny(tmp_path), dtype="float32", quantization="int8", num_kv_blocks=16)
    )
    kinds = {type(m).__name__ for m in engine.model.layers.modules()}
    assert "Int8Linear" in kinds and "Linear" not in kinds and "PackedLinear" not in kinds
    assert type(engine.model.lm_head).__name__ != "Int8Linear"  # the LM head stays float
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_linears(engine.model, "int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")


def _tiny(tmp_path) -> str:
    if not (tmp_path / "config.json").exists():
        make_hf_checkpoint("llama", tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("method, min_cos, min_top1", [("int8", 0.995, 0.90), ("fp8", 0.95, 0.60)])
def test_quantized_tiny_model_stays_close(tmp_path, method, min_cos, min_top1):
    cfg = dict(model=_tiny(tmp_path), dtype="float32", num_kv_blocks=32)
    reference = Engine(EngineConfig(**cfg))
    quantized = Engine(EngineConfig(**cfg, quantization=method))
    c = closeness(quantized, reference, random_prompts([5, 40, 77, 130, 20, 60], 512, seed=3))
    assert c.mean_cos >= min_cos and c.top1 >= min_top1, c


@pytest.mark.needs_smollm2
def test_quantized_smollm2_stays_close():
    reference = Engine(EngineConfig(model="smollm2", dtype="float32", kv_cache_memory_mib=32))
    tok = reference.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS[:4]]
    for method, min_cos, min_top1 in [("int8", 0.99, 0.90), ("fp8", 0.95, 0.65)]:
        quantized = Engine(EngineConfig(model="smollm2", quantization=method, kv_cache_memory_mib=32))
        c = closeness(quantized, reference, prompts)
        assert c.mean_cos >= min_cos and c.top1 >= min_top1, (method, c)
