"""Which checkpoint tensors a model has, and where this rank's slice of each goes.

Names are Hugging Face's, in one canonical spelling per family
(``canonical_name``): Mixtral's ``block_sparse_moe.experts.N.w1 / w3 / w2`` and
``block_sparse_moe.gate`` read as ``mlp.experts.N.gate_proj / up_proj / down_proj``
and ``mlp.gate``; Qwen2-MoE's ``mlp.shared_expert`` as ``mlp.shared_experts``.

A ``Placement`` says which rows of which parameter receive which range of the
tensor::

    checkpoint tensor (canonical name, full shape)      -> (parameter, index, rows, slice)
    layers.3.self_attn.k_proj.weight [KV*d, H]           -> self_attn.qkv_proj.weight rows [q, q+kv)
                                                            <- rows [k0*d, k1*d) of the file
    layers.3.mlp.experts.7.up_proj.weight [I, H]         -> mlp.experts.gate_up_proj[7] rows [I/tp, ...)
                                                            <- rows [i0, i1) of the file
    layers.3.self_attn.kv_b_proj.weight [h*(n+v), r]     -> rows of this rank's heads
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.decoder import DecoderModel
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.layers import kv_head_range, vocab_rows
from splitserve.wire.errors import ModelLoadError

_RENAMES = {
    "mixtral": (
        ("block_sparse_moe.gate.", "mlp.gate."),
        ("block_sparse_moe.experts.", "mlp.experts."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    ),
    "qwen2_moe": (("mlp.shared_expert.", "mlp.shared_experts."),),
    "qwen3_next": (("mlp.shared_expert.", "mlp.shared_experts."),),
    "gpt_oss": (("mlp.router.", "mlp.gate."),),  # its stacked experts: ``layouts.unstacked``
}


def canonical_name(cfg: ModelConfig, name: str) -> str:
    """``name`` in the spelling ``checkpoint_tensor_shapes`` uses (see the module docstring)."""
    for old, new in _RENAMES.get(cfg.model_type, ()):
        if old in name and ".layers." in name:
            name = name.replace(old, new)
    return name


def checkpoint_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face checkpoint of ``cfg`` (canonical names): name -> full shape."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_layers + cfg.num_mtp_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if cfg.is_linear(i):
            shapes.update(_linear_shapes(cfg, p + "linear_attn."))
        else:
            shapes.update(_mla_shapes(cfg, p) if cfg.mla is not None else _attention_shapes(cfg, p))
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if cfg.is_moe_layer(i):
            shapes.update(_moe_shapes(cfg, p + "mlp."))
        else:
            shapes.update(_mlp_shapes(h, cfg.intermediate_size, p + "mlp."))
        if i >= cfg.num_layers:  # a multi-token prediction layer (``engine.model.mtp``)
            shapes.update({p + n: (h,) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
            shapes[p + "eh_proj.weight"] = (h, 2 * h)
            shapes[p + "embed_tokens.weight"] = shapes[p + "shared_head.head.weight"] = (v, h)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _linear_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (``engine.model.deltanet``)."""
    lin, h = cfg.linear, cfg.hidden_size
    keys, values = lin.k_heads * lin.k_head_dim, lin.v_heads * lin.v_head_dim
    channels = 2 * keys + values
    out: dict[str, tuple[int, ...]] = {}
    if lin.fused:
        out[p + "in_proj_qkvz.weight"] = (channels + values, h)
        out[p + "in_proj_ba.weight"] = (2 * lin.v_heads, h)
    else:
        out[p + "in_proj_qkv.weight"] = (channels, h)
        out[p + "in_proj_z.weight"] = (values, h)
        out[p + "in_proj_b.weight"] = out[p + "in_proj_a.weight"] = (lin.v_heads, h)
    out[p + "conv1d.weight"] = (channels, 1, lin.conv_width)
    out[p + "dt_bias"] = out[p + "A_log"] = (lin.v_heads,)
    out[p + "norm.weight"] = (lin.v_head_dim,)
    out[p + "out_proj.weight"] = (h, values)
    return out


def _attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    q_rows = cfg.q_size * (2 if cfg.attn_output_gate else 1)  # each head's query, then its gate
    for proj, rows in (("q_proj", q_rows), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
        out[f"{p}self_attn.{proj}.weight"] = (rows, h)
        if cfg.qkv_bias:
            out[f"{p}self_attn.{proj}.bias"] = (rows,)
    if cfg.qk_norm:
        out[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
        out[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
    if cfg.attn_sinks:
        out[p + "self_attn.sinks"] = (cfg.num_heads,)
    out[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
    if cfg.o_bias:
        out[p + "self_attn.o_proj.bias"] = (h,)
    return out


def _mla_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    a = p + "self_attn."
    out: dict[str, tuple[int, ...]] = {}
    if m.q_lora_rank:
        out[a + "q_a_proj.weight"] = (m.q_lora_rank, h)
        out[a + "q_a_layernorm.weight"] = (m.q_lora_rank,)
        out[a + "q_b_proj.weight"] = (heads * m.qk_head_dim, m.q_lora_rank)
    else:
        out[a + "q_proj.weight"] = (heads * m.qk_head_dim, h)
    out[a + "kv_a_proj_with_mqa.weight"] = (m.score_dim, h)
    if m.index_topk:  # DeepSeek-V3.2's indexer
        i = a + "indexer."
        out[i + "wq_b.weight"] = (m.index_n_heads * m.index_head_dim, m.q_lora_rank)
        out[i + "wk.weight"] = (m.index_head_dim, h)
        out[i + "k_norm.weight"] = out[i + "k_norm.bias"] = (m.index_head_dim,)
        out[i + "weights_proj.weight"] = (m.index_n_heads, h)
    out[a + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
    out[a + "kv_b_proj.weight"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    out[a + "o_proj.weight"] = (h, heads * m.v_head_dim)
    return out


def _mlp_shapes(h: int, inter: int, p: str, bias: bool = False) -> dict[str, tuple[int, ...]]:
    out = {
        p + "gate_proj.weight": (inter, h),
        p + "up_proj.weight": (inter, h),
        p + "down_proj.weight": (h, inter),
    }
    if bias:
        out |= {p + "gate_proj.bias": (inter,), p + "up_proj.bias": (inter,), p + "down_proj.bias": (h,)}
    return out


def _moe_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    moe, h = cfg.moe, cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {p + "gate.weight": (moe.num_experts, h)}
    if moe.correction_bias:
        out[p + "gate.e_score_correction_bias"] = (moe.num_experts,)
    if moe.router_bias:
        out[p + "gate.bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        out.update(_mlp_shapes(h, moe.intermediate_size, f"{p}experts.{e}.", moe.expert_bias))
    if moe.shared_intermediate_size:
        out.update(_mlp_shapes(h, moe.shared_intermediate_size, p + "shared_experts."))
    if moe.shared_gate:
        out[p + "shared_expert_gate.weight"] = (1, h)
    return out


@dataclass(frozen=True)
class Placement:
    """Where this rank's slice of one checkpoint tensor goes: rows from ``row0`` on of
    ``param`` (of ``param[index]`` when ``index`` is set: one expert of a stack)
    receive the tensor's range [start, stop) along ``dim`` (the whole tensor when
    ``dim`` is None). ``pad_rows`` more rows after it are zeroed (the last rank's
    share of a vocabulary that does not split evenly)."""

    param: torch.Tensor
    row0: int = 0
    dim: int | None = None
    start: int = 0
    stop: int | None = None
    pad_rows: int = 0
    index: int | None = None

    @property
    def target(self) -> torch.Tensor:
        """The tensor written: ``param``, or its ``index``-th row."""
        return self.param if self.index is None else self.param[self.index]


# not read here: a routed expert another expert-parallel rank holds, an unused MTP layer
_ELSEWHERE = object()


def placement(model: DecoderModel, tp: TPGroup, name: str) -> Placement | None:
    """Where checkpoint tensor ``name`` (canonical, ``model.`` prefix removed) lands on
    this rank; None for a tensor this rank never reads (a routed expert another
    expert-parallel rank holds; an MTP layer's, ``_mtp_placement``). ``ModelLoadError``
    for a tensor with no place in the model."""
    cfg = model.config
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, stop, rows = vocab_rows(cfg.vocab_size, tp)
        param = model.embed_tokens.weight if name == "embed_tokens.weight" else model.lm_head.linear.weight
        return Placement(param, 0, 0, start, stop, pad_rows=rows - (stop - start))
    if name == "norm.weight":
        return Placement(model.norm.weight)
    try:
        _, i, module, rest = name.split(".", 3)
        index = int(i)
    except ValueError:
        raise ModelLoadError(f"checkpoint tensor {name} has no place in the model") from None
    found = None
    if 0 <= index < cfg.num_layers:
        found = _layer_placement(cfg, model.layers[index], index, tp, module, rest)
    elif cfg.num_layers <= index < cfg.num_layers + cfg.num_mtp_layers:
        found = _mtp_placement(model, tp, index, module, rest)
    if found is None:
        raise ModelLoadError(f"checkpoint tensor {name} has no place in the model")
    return None if found is _ELSEWHERE else found


def _layer_placement(cfg: ModelConfig, layer, index: int, tp: TPGroup, module: str, rest: str):
    if module in ("input_layernorm", "post_attention_layernorm") or (
        module in ("pre_feedforward_layernorm", "post_feedforward_layernorm") and cfg.sandwich_norms
    ):
        return Placement(getattr(layer, module).weight)
    if module == "linear_attn" and cfg.is_linear(index):
        return _linear_placement(cfg, layer.linear_attn, tp, rest)
    if module == "self_attn" and cfg.mla is not None:
        return _mla_placement(cfg, layer.self_attn, tp, rest)
    if module == "self_attn":
        return _attention(cfg, layer, tp, rest)
    if module == "mlp" and cfg.is_moe_layer(index):
        return _moe_placement(layer.mlp, tp, rest)
    if module == "mlp":
        return _mlp(layer.mlp, tp, rest)
    return None


def _linear_placement(
    cfg: ModelConfig, lin, tp: TPGroup, rest: str
) -> Placement | tuple[Placement, ...] | None:
    """A Gated DeltaNet tensor's rows of this rank's key heads (and their value heads:
    ``deltanet.GatedDeltaNet``). Its q, k and v channels (the convolution's, Qwen3.5's
    ``in_proj_qkv``) are three ranges of the tensor, one place each; Qwen3-Next's fused
    projections are grouped by key head, one range."""
    c = cfg.linear
    k0, k1 = tp.shard_range(c.k_heads)
    v0, v1 = tp.shard_range(c.v_heads)
    keys, dk, dv = c.k_heads * c.k_head_dim, c.k_head_dim, c.v_head_dim
    local_keys = (k1 - k0) * dk

    def qkv(param) -> tuple[Placement, ...]:
        return (
            Placement(param, 0, 0, k0 * dk, k1 * dk),
            Placement(param, local_keys, 0, keys + k0 * dk, keys + k1 * dk),
            Placement(param, 2 * local_keys, 0, 2 * keys + v0 * dv, 2 * keys + v1 * dv),
        )

    per = c.v_heads // c.k_heads
    match rest:
        case "in_proj_qkvz.weight" if c.fused:
            group = 2 * dk + 2 * per * dv
            return Placement(lin.in_proj_qkvz.weight, 0, 0, k0 * group, k1 * group)
        case "in_proj_ba.weight" if c.fused:
            return Placement(lin.in_proj_ba.weight, 0, 0, k0 * 2 * per, k1 * 2 * per)
        case "in_proj_qkv.weight" if not c.fused:
            return qkv(lin.in_proj_qkv.weight)
        case "in_proj_z.weight" if not c.fused:
            return Placement(lin.in_proj_z.weight, 0, 0, v0 * dv, v1 * dv)
        case "in_proj_b.weight" | "in_proj_a.weight" if not c.fused:
            return Placement(getattr(lin, rest.removesuffix(".weight")).weight, 0, 0, v0, v1)
        case "conv1d.weight":
            return qkv(lin.conv1d.weight)
        case "dt_bias" | "A_log":
            return Placement(getattr(lin, rest), 0, 0, v0, v1)
        case "norm.weight":
            return Placement(lin.norm.weight)
        case "out_proj.weight":
            return Placement(lin.out_proj.linear.weight, 0, 1, v0 * dv, v1 * dv)
    return None


def _mtp_placement(model: DecoderModel, tp: TPGroup, index: int, module: str, rest: str):
    """A multi-token prediction layer's tensor: read into ``model.mtp`` (the first
    such layer, when the model was built with it); not read otherwise, nor the
    layer's copies of the embedding and LM head (``engine.model.mtp``)."""
    mtp = model.mtp
    if mtp is None or index > model.config.num_layers or module == "embed_tokens":
        return _ELSEWHERE
    if (module, rest) == ("shared_head", "head.weight"):
        return _ELSEWHERE
    if (module, rest) == ("shared_head", "norm.weight"):
        return Placement(mtp.norm.weight)
    if module in ("enorm", "hnorm", "eh_proj") and rest == "weight":
        return Placement(getattr(mtp, module).weight)
    return _layer_placement(model.config, mtp.layer, index, tp, module, rest)


def _attention(cfg: ModelConfig, layer, tp: TPGroup, rest: str) -> Placement | None:
    attn, d = layer.self_attn, cfg.head_dim
    h0, h1 = tp.shard_range(cfg.num_heads)
    if rest == "sinks" and attn.sinks is not None:  # one per head: this rank's heads'
        return Placement(attn.sinks, 0, 0, h0, h1)
    if "." not in rest:
        return None
    proj, kind = rest.rsplit(".", 1)
    k0, k1 = kv_head_range(cfg.num_kv_heads, tp)
    match proj:
        case "q_proj":  # with an output gate, each head's 2d rows: its query, then its gate
            g = 2 if cfg.attn_output_gate else 1
            return Placement(getattr(attn.qkv_proj, kind), 0, 0, h0 * d * g, h1 * d * g)
        case "k_proj":
            return Placement(getattr(attn.qkv_proj, kind), attn.q_rows, 0, k0 * d, k1 * d)
        case "v_proj":
            return Placement(getattr(attn.qkv_proj, kind), attn.q_rows + attn.kv_size, 0, k0 * d, k1 * d)
        case "q_norm" | "k_norm":
            return Placement(getattr(attn, proj).weight)
        case "o_proj" if kind == "bias":
            return Placement(attn.o_proj.bias)
        case "o_proj":
            return Placement(attn.o_proj.linear.weight, 0, 1, h0 * d, h1 * d)
    return None


def _mla_placement(cfg: ModelConfig, attn, tp: TPGroup, rest: str) -> Placement | None:
    m = cfg.mla
    h0, h1 = tp.shard_range(cfg.num_heads)
    if rest.startswith("indexer.") and attn.indexer is not None:  # whole on every rank
        module, kind = rest.removeprefix("indexer.").rsplit(".", 1)
        found = getattr(attn.indexer, module, None)
        return Placement(getattr(found, kind)) if found is not None and hasattr(found, kind) else None
    proj = rest.removesuffix(".weight")
    match proj:
        case "q_a_proj" | "kv_a_proj_with_mqa" | "q_a_layernorm" | "kv_a_layernorm":
            return Placement(getattr(attn, proj).weight)
        case "q_proj" | "q_b_proj":
            return Placement(getattr(attn, proj).weight, 0, 0, h0 * m.qk_head_dim, h1 * m.qk_head_dim)
        case "kv_b_proj":
            per = m.qk_nope_head_dim + m.v_head_dim
            return Placement(attn.kv_b_proj.weight, 0, 0, h0 * per, h1 * per)
        case "o_proj":
            return Placement(attn.o_proj.linear.weight, 0, 1, h0 * m.v_head_dim, h1 * m.v_head_dim)
    return None


def _mlp(mlp, tp: TPGroup, rest: str, index: int | None = None) -> Placement | None:
    """A dense MLP's tensor (``rest``: ``gate_proj.weight`` ...), or one expert's
    (``index``: its row of the stacked ``mlp``: ``moe.Experts``)."""
    inter = mlp.inter if index is None else mlp.down_proj.shape[2]
    i0, i1 = tp.shard_range(inter * tp.size)
    gate_up = mlp.gate_up_proj.weight if index is None else mlp.gate_up_proj
    down = mlp.down_proj.linear.weight if index is None else mlp.down_proj
    match rest:
        case "gate_proj.weight":
            return Placement(gate_up, 0, 0, i0, i1, index=index)
        case "up_proj.weight":
            return Placement(gate_up, inter, 0, i0, i1, index=index)
        case "down_proj.weight":
            return Placement(down, 0, 1, i0, i1, index=index)
    biases = None if index is None else (mlp.gate_up_bias, mlp.down_bias)  # an expert's (gpt-oss)
    if biases is None or biases[0] is None:
        return None
    match rest:
        case "gate_proj.bias":
            return Placement(biases[0], 0, 0, i0, i1, index=index)
        case "up_proj.bias":
            return Placement(biases[0], inter, 0, i0, i1, index=index)
        case "down_proj.bias":  # whole on every rank; one rank of a TP group adds it (moe.ExpertForm)
            return Placement(biases[1], index=index)
    return None


def _moe_placement(moe, tp: TPGroup, rest: str) -> Placement | object | None:
    if rest == "gate.weight":
        return Placement(moe.gate.weight)
    if rest == "gate.e_score_correction_bias" and moe.gate.e_score_correction_bias is not None:
        return Placement(moe.gate.e_score_correction_bias)
    if rest == "gate.bias" and moe.gate.bias is not None:
        return Placement(moe.gate.bias)
    if rest == "shared_expert_gate.weight" and moe.shared_expert_gate is not None:
        return Placement(moe.shared_expert_gate.weight)
    if rest.startswith("shared_experts.") and moe.shared_experts is not None:
        return _mlp(moe.shared_experts, tp, rest.removeprefix("shared_experts."))
    if rest.startswith("experts."):
        _, e, tail = rest.split(".", 2)
        if e.isdigit() and int(e) < moe.moe.num_experts:
            held = int(e) - moe.shard.first
            if not 0 <= held < moe.shard.count:
                return _ELSEWHERE
            return _mlp(moe.experts, tp, tail, index=held)
    return None
