"""Pre-quantized FP8 checkpoints in both formats (``quant_method: fp8`` with block
scales, and compressed-tensors FP8 per channel and per tensor), written from a
random float model by ``bench/fp8_checkpoint.py``, which also writes the exactly
dequantized float checkpoint: the FP8 checkpoint must give the same logits (CPU
dequantizes at load), each TP rank must hold its slice of the dequantized weights,
and a malformed or unsupported checkpoint gets an error naming the problem."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.bench.fp8_checkpoint import write_fp8_checkpoint
from splitserve.bench.quant_accuracy import prompt_logits
from splitserve.engine.engine import Engine
from splitserve.engine.model.checkpoint import safetensors_tensors
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import load_model
from splitserve.engine.model.quant import Fp8CheckpointLinear
from splitserve.engine.parallel.group import TPGroup
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import ModelLoadError
from tests.conftest import make_hf_checkpoint, random_prompts

BLOCK = 32  # the tiny models' widths (64, 128) are multiples of it; real checkpoints use 128


@pytest.fixture(scope="module", params=["block", "channel", "tensor"])
def checkpoints(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    kind = "qwen2" if request.param == "tensor" else "llama"  # qwen2: q/k/v biases stay float
    make_hf_checkpoint(kind, root / "float")
    write_fp8_checkpoint(root / "float", root / "fp8", request.param, BLOCK, root / "deq")
    return request.param, root


def _engine(directory) -> Engine:
    return Engine(EngineConfig(model=str(directory), dtype="float32", num_kv_blocks=64, block_size=8))


def test_fp8_checkpoint_logits_equal_the_dequantized_models(checkpoints):
    fmt, root = checkpoints
    weights = load_file(str(root / "fp8" / "model.safetensors"))
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    prompts = random_prompts([9, 40], 512, seed=5)
    fp8, deq, full = (_engine(root / d) for d in ("fp8", "deq", "float"))
    for p in prompts:
        got, want = prompt_logits(fp8, p), prompt_logits(deq, p)
        # stated tolerance: float32 rounding of the same products, summed in another order
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        cos = torch.nn.functional.cosine_similarity(got, prompt_logits(full, p), dim=-1)
        assert cos.mean() > 0.98  # and FP8 stays close to the float model it came from


def test_each_tp_rank_holds_its_slice_of_the_dequantized_weights(checkpoints):
    fmt, root = checkpoints
    cfg = ModelConfig.from_hf(json_config(root / "fp8"))
    deq = load_model(
        cfg_without_quant(cfg), torch.float32, torch.device("cpu"), 64, safetensors_tensors(root / "deq")
    )
    for rank in range(2):
        shard = load_model(
            cfg,
            torch.float32,
            torch.device("cpu"),
            64,
            safetensors_tensors(root / "fp8"),
            tp=TPGroup(rank, 2),
        )
        attn, ref = shard.layers[1].self_attn, deq.layers[1].self_attn
        assert (
            isinstance(attn.qkv_proj, Fp8CheckpointLinear)
            and attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        )
        q, kv = cfg.q_size // 2, cfg.kv_size // 2
        full = ref.qkv_proj.weight
        rows = torch.cat(
            [
                full[rank * q : (rank + 1) * q],
                full[cfg.q_size + rank * kv : cfg.q_size + (rank + 1) * kv],
                full[cfg.q_size + cfg.kv_size + rank * kv : cfg.q_size + cfg.kv_size + (rank + 1) * kv],
            ]
        )
        assert torch.equal(attn.qkv_proj.dequantized_weight(), rows)
        cols = ref.o_proj.linear.weight[:, rank * q : (rank + 1) * q]
        assert torch.equal(attn.o_proj.linear.dequantized_weight(), cols)


def json_config(directory):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory))


def cfg_without_quant(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, checkpoint_quant=None)


def test_the_gpu_kernel_path_and_the_dequantizing_path_agree():
    torch.manual_seed(0)
    layer = Fp8CheckpointLinear(64, 48, 2, bias=True)
    layer.weight.copy_((torch.randn(48, 64) * 100).clamp(-448, 448).to(torch.float8_e4m3fn))
    layer.weight_scale.copy_(torch.rand(48, 2) / 100)
    layer.bias.copy_(torch.randn(48))
    layer.ready()
    x = torch.randn(5, 64)
    want = torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias)
    assert torch.allclose(layer(x), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer.dequantized_linear(torch.float32)(x), want, rtol=1e-5, atol=1e-5)


def test_a_malformed_or_missing_scale_is_named(tmp_path):
    make_hf_checkpoint("llama", tmp_path / "float")
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "block", BLOCK)
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    tensors[name] = torch.ones(3, 3)
    save_file(tensors, str(path))
    with pytest.raises(
        ModelLoadError, match=r"up_proj.weight_scale_inv has shape \(3, 3\), expected \(4, 2\)"
    ):
        _engine(tmp_path / "fp8")
    del tensors[name]
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match="missing 1 tensors.*layers.1.mlp.gate_up_proj.weight_scale"):
        _engine(tmp_path / "fp8")


@pytest.mark.parametrize(
    "qc, needle",
    [
        ({"quant_method": "awq", "bits": 4}, "method 'awq' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128, 64]}, "square weight_block_size"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "4 bits, type 'int' are not supported",
        ),
    ],
)
def test_an_unsupported_quantization_is_refused_naming_it(tmp_path, qc, needle):
    make_hf_checkpoint("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    with pytest.raises(ModelLoadError, match=needle):
        _engine(tmp_path)
