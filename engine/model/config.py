"""The engine's view of a model architecture, read from a Hugging Face config.

One dataclass covers every family the decoder (``engine.model.decoder``) builds:

- attention: GQA (Llama 2/3 with their RoPE variants, Mistral, Qwen2 with q/k/v
  bias, Qwen3 with per-head q/k RMSNorm, SmolLM2; gpt-oss with biases, attention
  sinks and sliding-window layers; Gemma 3 with q/k norms, 5 sliding layers to 1
  full, each kind with its own RoPE) or DeepSeek's multi-head latent attention
  (``mla``: DeepSeek-V3; V3.2 with its sparse attention's indexer);
- MLP: dense, or a mixture of experts (``moe``: Mixtral, Qwen2-MoE, Qwen3-MoE,
  DeepSeek-V3, gpt-oss, GLM-4.5 with DeepSeek-V3's routing over GQA attention
  whose RoPE turns only part of each head, ``rotary_dim``), with the layers that
  stay dense listed.

Gemma 3's other differences are flags here: norms that scale by ``1 + weight``
(``norm_unit_offset``), a norm after attention and around the MLP as well
(``sandwich_norms``), the tanh-approximated GELU (``hidden_act``), embeddings
scaled by sqrt(hidden) (``embed_scale``), a query scale of its own
(``attn_scale``) and logits soft-capped where the config asks
(``final_logit_softcap``). Gemma 2 has the same, without q/k norms or a second
RoPE, and also soft-caps each attention logit (``attn_softcap``:
``cap * tanh(logit / cap)`` before the softmax; a Gemma 3 config's
``attn_logit_softcapping`` is not applied, as transformers does not).

Sliding-window layers (``layer_types``, ``sliding_window``): a query at position p
attends to the keys at positions (p - window, p], as transformers' masks do; the
other layers attend to every earlier key. Every layer's cache still holds the
whole sequence (a sliding layer's older blocks are not freed yet; a handoff sends
them only from the window on: ``KVLayout.window_from``).

With MLA the KV cache holds one latent row per token and layer instead of K and
V heads: ``num_kv_heads`` is 1, ``head_dim`` is the row's width
(``kv_lora_rank + qk_rope_head_dim``) and ``kv_planes`` is 1 (2 for K and V).

Hybrid models (Qwen3-Next, Qwen3.5): ``layer_types`` mixes "linear_attention"
layers (Gated DeltaNet, ``linear``: no KV, a fixed-size state per sequence) with
"full_attention" ones, whose attention output is gated (``attn_output_gate``);
``kv_layers`` lists the layers with a KV cache.

Anything outside what the model code implements is refused here with
``ModelLoadError`` rather than silently computing something else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.model.checkpoint_quant import CheckpointQuant
from splitserve.wire.errors import ModelLoadError

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "qwen3_5_text")
WINDOWED_MODEL_TYPES = ("gpt_oss", "gemma2", "gemma3_text")  # per-layer ``layer_types``
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
MOE_MODEL_TYPES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "deepseek_v32",
    "gpt_oss",
    "glm4_moe",
    "qwen3_next",
)
# linear-attention (Gated DeltaNet) layers beside full ones (``engine.model.deltanet``)
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
# model types a user may try whose missing pieces we can name
NOT_YET = {
    "deepseek_v2": "DeepSeek-V2's softmax routing with group-limited greedy top-k (DeepSeek-V3 is supported)",
}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: how tokens are routed and what each expert is.

    Routing (``engine.model.moe.route``): scores are ``softmax`` (Mixtral, Qwen) or
    ``sigmoid`` (DeepSeek-V3) of the router's logits, in float32; the experts are
    chosen by score plus the correction bias (if any), within the ``topk_groups``
    best of ``num_groups`` groups (a group's score: the sum of its two best), and
    weighted by their scores, renormalised to sum to 1 if ``renormalize``, times
    ``routed_scaling``. Shared experts (one MLP of ``shared_intermediate_size``)
    see every token; Qwen2-MoE gates theirs by ``sigmoid(shared_expert_gate(x))``.

    gpt-oss: the router has a bias, each expert's projections have biases, and the
    activation is ``clamped_swiglu``: gate clamped above at ``swiglu_limit``, up to
    [-limit, limit], ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` (the
    default ``silu``: ``silu(gate) * up``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    renormalize: bool = True
    routed_scaling: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False
    shared_intermediate_size: int = 0  # 0: no shared experts
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense (of the model's intermediate_size)
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # "silu" | "clamped_swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: a query of ``qk_nope + qk_rope`` per
    head (through a ``q_lora_rank`` bottleneck, or one projection when None); per
    token one latent ``kv_lora_rank`` vector (normed) and one ``qk_rope`` key shared
    by every head, which is all the cache holds; ``kv_b_proj`` expands the latent
    into each head's ``qk_nope`` key and ``v_head_dim`` value.

    DeepSeek-V3.2's sparse attention (``index_topk`` > 0): a lightning indexer of
    ``index_n_heads`` heads of ``index_head_dim`` scores every earlier token and
    each query attends only to its ``index_topk`` best (``engine.model.mla``); the
    indexer's key of a token is kept at the end of its cache row, so the handoff,
    migration and the host tier move it with the latent."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs are (x0, x1), (x2, x3), ...: de-interleaved before rotation
    index_topk: int = 0  # 0: dense MLA (V3)
    index_n_heads: int = 0
    index_head_dim: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def score_dim(self) -> int:
        """Width of the latent and the rotary key: what a query scores against."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one token's cache row: the latent, the rotary key and (V3.2) the
        indexer's key."""
        return self.score_dim + self.index_head_dim


@dataclass(frozen=True)
class LinearAttentionConfig:
    """A hybrid model's Gated DeltaNet layers (the config's ``linear_*`` fields):
    ``k_heads`` query/key heads of ``k_head_dim``, ``v_heads`` value heads of
    ``v_head_dim`` (a multiple of ``k_heads``), a causal convolution ``conv_width``
    wide; ``fused``: Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` (Qwen3.5
    projects each apart)."""

    k_heads: int
    v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_width: int
    fused: bool


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e4})
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    checkpoint_quant: CheckpointQuant | None = None  # the checkpoint's own FP8 weights, if any
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    # DeepSeek-V3's multi-token prediction layers after the decoder's (the checkpoint's
    # ``model.layers.{num_layers}.*``; ``num_nextn_predict_layers``): ``engine.model.mtp``
    num_mtp_layers: int = 0
    # per layer "full_attention" or "sliding_attention" (empty: every layer full);
    # a sliding layer attends to the last ``sliding_window`` positions (module docstring)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attn_sinks: bool = False  # gpt-oss: a learned logit per head beside the keys in the softmax
    rope_local: dict[str, Any] | None = None  # the sliding layers' RoPE where it differs (Gemma 3)
    rotary_dim: int | None = None  # the leading dimensions of a head RoPE turns (GLM: half); None: all
    # Gemma 3 (module docstring)
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    embed_scale: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcap: float | None = None
    attn_softcap: float | None = None  # Gemma 2: each attention logit soft-capped
    # hybrid models (Qwen3-Next, Qwen3.5): their "linear_attention" layers' shapes, and
    # the full layers' output gate (q_proj gives each head's query and a gate whose
    # sigmoid scales its output)
    linear: LinearAttentionConfig | None = None
    attn_output_gate: bool = False

    def is_linear(self, i: int) -> bool:
        """Whether layer i is a linear-attention (Gated DeltaNet) layer: no KV cache."""
        return i < len(self.layer_types) and self.layer_types[i] == "linear_attention"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache, in order (every layer but the linear ones)."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear(i))

    def window(self, i: int) -> int | None:
        """Layer i's sliding window, or None where it attends to every earlier key."""
        if i < len(self.layer_types) and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_planes(self) -> int:
        """Cache planes per layer: 2 (K and V), or 1 (MLA's latent)."""
        return 1 if self.mla is not None else 2

    @property
    def rope_dim(self) -> int:
        """Dimensions the rotary embedding turns: a head's (its first ``rotary_dim``
        where set), or MLA's rotary key's."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's KV takes in the whole model's cache at 1 byte per element
        (multiply by the element size): layers x planes x KV heads x head_dim. For MLA
        ``num_layers x (kv_lora_rank + qk_rope_head_dim)``; for GQA
        ``num_layers x 2 x num_kv_heads x head_dim``; a hybrid model's linear layers
        hold none."""
        return len(self.kv_layers) * self.kv_planes * self.num_kv_heads * self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i not in self.moe.dense_layers

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a ``transformers.PretrainedConfig``; raise for unsupported features."""
        mt = getattr(hf, "model_type", None)
        if mt in NOT_YET:
            raise ModelLoadError(f"model_type {mt!r} is not supported yet: splitserve lacks {NOT_YET[mt]}")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type {mt!r} is not supported; splitserve runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(hf, "mlp_bias", False):
            raise ModelLoadError("MLP bias is not supported")
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"activation {act!r} is not supported (only {', '.join(_ACTIVATIONS)})")
        if getattr(hf, "use_bidirectional_attention", False):
            raise ModelLoadError("bidirectional attention is not supported (a decoder runs causal attention)")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        max_pos = hf.max_position_embeddings
        gemma, gemma3 = mt in GEMMA_MODEL_TYPES, mt == "gemma3_text"
        hybrid = mt in HYBRID_MODEL_TYPES
        # Gemma 2 caps its attention logits; transformers' Gemma 3 reads the field and never
        # applies it (its released configs leave it null), so neither does the engine
        attn_softcap = getattr(hf, "attn_logit_softcapping", None) if mt == "gemma2" else None
        if attn_softcap is not None and not attn_softcap > 0:
            raise ModelLoadError(f"config.json: attn_logit_softcapping {attn_softcap!r} is not positive")
        window = getattr(hf, "sliding_window", None)
        layer_types, sliding = _layer_types(hf, mt, max_pos)
        uses_window = mt in ("mistral", "mixtral") or getattr(hf, "use_sliding_window", False)
        if window and not layer_types and uses_window:
            # Within the window, sliding-window attention equals full attention.
            max_pos = min(max_pos, window)
        quant_config = getattr(hf, "quantization_config", None)
        if mt == "gpt_oss" and _quant_method(quant_config) == "mxfp4":
            quant_config = None  # its experts are dequantised as they are read (``layouts``)
        quant = CheckpointQuant.from_config(quant_config)
        moe, mla = _moe_config(hf, mt), _mla_config(hf, mt)
        if quant is not None and (moe is not None or mla is not None):
            raise ModelLoadError(f"FP8 checkpoints of {mt} models are not supported yet (dense models are)")
        if mla is not None:
            heads_kv, head_dim = 1, mla.latent_dim
        else:
            heads_kv, head_dim = getattr(hf, "num_key_value_heads", None) or heads, head_dim
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=heads_kv,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=mt in ("qwen2", "qwen2_moe") or attention_bias,
            o_bias=mt in ("llama", "mistral", "mixtral", "gpt_oss") and attention_bias,
            qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3_text", *HYBRID_MODEL_TYPES)
            or bool(getattr(hf, "use_qk_norm", False)),
            rope=_rope_params(hf, "full_attention" if gemma3 else None),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
            checkpoint_quant=quant,
            moe=moe,
            mla=mla,
            num_mtp_layers=_mtp_layers(hf, mt),
            layer_types=layer_types,
            sliding_window=sliding,
            attn_sinks=mt == "gpt_oss",
            rope_local=_rope_params(hf, "sliding_attention") if gemma3 else None,
            rotary_dim=_rotary_dim(hf, head_dim) if mla is None else None,
            norm_unit_offset=gemma or hybrid,
            sandwich_norms=gemma,
            hidden_act=_ACTIVATIONS[act],
            embed_scale=hf.hidden_size**0.5 if gemma else None,
            attn_scale=hf.query_pre_attn_scalar**-0.5 if gemma else None,
            final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
            attn_softcap=attn_softcap,
            linear=_linear_config(hf, mt),
            attn_output_gate=hybrid,
        )


def _quant_method(qc: Any) -> str | None:
    if qc is None:
        return None
    return qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)


def _mtp_layers(hf: Any, mt: str) -> int:
    """Multi-token prediction layers after the decoder's (DeepSeek-V3's; GLM-4.5's
    checkpoints carry one of the same form, read only when the ``mtp`` method runs)."""
    if mt not in ("deepseek_v3", "deepseek_v32", "glm4_moe"):
        return 0
    return int(getattr(hf, "num_nextn_predict_layers", 0) or 0)


def _rotary_dim(hf: Any, head_dim: int) -> int | None:
    """The dimensions RoPE turns where ``partial_rotary_factor`` (top level, or in
    ``rope_parameters``) makes it fewer than a head's; None where it turns all."""
    factor = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf, "partial_rotary_factor", None) or 1.0
    if factor == 1.0:
        return None
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2:
        raise ModelLoadError(f"partial_rotary_factor {factor} leaves {dim} rotary dimensions: not even, or 0")
    return dim


# config spellings -> the engine's (``llama.MLP``)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


LAYER_TYPES = ("full_attention", "sliding_attention")
HYBRID_LAYER_TYPES = ("full_attention", "linear_attention")


def _linear_config(hf: Any, mt: str) -> LinearAttentionConfig | None:
    """A hybrid model's linear-attention shapes; ``ModelLoadError`` where they do not fit."""
    if mt not in HYBRID_MODEL_TYPES:
        return None
    lin = LinearAttentionConfig(
        k_heads=hf.linear_num_key_heads,
        v_heads=hf.linear_num_value_heads,
        k_head_dim=hf.linear_key_head_dim,
        v_head_dim=hf.linear_value_head_dim,
        conv_width=hf.linear_conv_kernel_dim,
        fused=mt == "qwen3_next",
    )
    if min(lin.k_heads, lin.v_heads, lin.k_head_dim, lin.v_head_dim) < 1 or lin.v_heads % lin.k_heads:
        raise ModelLoadError(
            f"config.json: {lin.v_heads} linear value heads do not group over {lin.k_heads} key heads"
        )
    if lin.conv_width < 2:
        raise ModelLoadError(f"config.json: linear_conv_kernel_dim {lin.conv_width} is below 2")
    return lin


def _layer_types(hf: Any, mt: str, max_pos: int) -> tuple[tuple[str, ...], int | None]:
    """(per-layer types, the sliding window) of a family whose layers differ (gpt-oss);
    ((), None) for the others. ``ModelLoadError`` for an unknown type, a list of the
    wrong length, or a window that is not a positive number within the context."""
    if mt not in WINDOWED_MODEL_TYPES + HYBRID_MODEL_TYPES:
        return (), None
    types = tuple(getattr(hf, "layer_types", None) or ())
    if len(types) != hf.num_hidden_layers:
        raise ModelLoadError(
            f"config.json: layer_types lists {len(types)} layers; the model has {hf.num_hidden_layers}"
        )
    known = HYBRID_LAYER_TYPES if mt in HYBRID_MODEL_TYPES else LAYER_TYPES
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise ModelLoadError(
            f"config.json: layer_types has {unknown[0]!r}, which splitserve does not run "
            f"for {mt} (it runs {', '.join(known)})"
        )
    window = getattr(hf, "sliding_window", None)
    if "sliding_attention" not in types:
        return types, None
    if not isinstance(window, int) or not 0 < window <= max_pos:
        raise ModelLoadError(
            f"config.json: sliding_window {window!r} is not a window within the context "
            f"(1 to max_position_embeddings, {max_pos})"
        )
    return types, window


def _moe_config(hf: Any, mt: str) -> MoEConfig | None:
    """The family's MoE settings in one record (None for a dense family)."""
    top_k = getattr(hf, "num_experts_per_tok", 0)
    if mt == "mixtral":
        return MoEConfig(hf.num_local_experts, top_k, hf.intermediate_size)
    if mt in ("qwen2_moe", "qwen3_moe", "qwen3_next"):  # Qwen3-Next's: Qwen2-MoE's gated shared expert
        experts = getattr(hf, "num_experts", None) or hf.num_local_experts
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        only = set(getattr(hf, "mlp_only_layers", None) or ())
        dense = tuple(i for i in range(hf.num_hidden_layers) if i in only or (i + 1) % step)
        shared = getattr(hf, "shared_expert_intermediate_size", 0) if mt != "qwen3_moe" else 0
        return MoEConfig(
            experts,
            top_k,
            hf.moe_intermediate_size,
            renormalize=bool(getattr(hf, "norm_topk_prob", False)),
            shared_intermediate_size=shared,
            shared_gate=bool(shared),
            dense_layers=dense,
        )
    if mt == "gpt_oss":
        return MoEConfig(
            hf.num_local_experts,
            top_k,
            hf.intermediate_size,
            router_bias=True,
            expert_bias=True,
            activation="clamped_swiglu",
            swiglu_alpha=float(hf.swiglu_alpha),
            swiglu_limit=float(hf.swiglu_limit),
        )
    if mt in ("deepseek_v3", "deepseek_v32", "glm4_moe"):  # V3.2 and GLM-4.5 route as DeepSeek-V3
        if getattr(hf, "scoring_func", "sigmoid") != "sigmoid":
            raise ModelLoadError(f"DeepSeek-V3 scoring {hf.scoring_func!r} is not supported (only sigmoid)")
        experts = getattr(hf, "n_routed_experts", None) or hf.num_local_experts
        if experts % hf.n_group:
            raise ModelLoadError(f"{experts} experts do not split into {hf.n_group} groups")
        return MoEConfig(
            experts,
            top_k,
            hf.moe_intermediate_size,
            scoring="sigmoid",
            renormalize=bool(hf.norm_topk_prob),
            routed_scaling=float(hf.routed_scaling_factor),
            num_groups=hf.n_group,
            topk_groups=hf.topk_group,
            correction_bias=True,
            shared_intermediate_size=hf.moe_intermediate_size * (hf.n_shared_experts or 0),
            dense_layers=tuple(range(min(hf.first_k_dense_replace, hf.num_hidden_layers))),
        )
    return None


def _mla_config(hf: Any, mt: str) -> MLAConfig | None:
    if mt not in ("deepseek_v3", "deepseek_v32"):
        return None
    index = {}
    if mt == "deepseek_v32":
        if not hf.q_lora_rank:
            raise ModelLoadError("config.json: DeepSeek-V3.2's indexer needs q_lora_rank (its q bottleneck)")
        index = {k: getattr(hf, k) for k in ("index_topk", "index_n_heads", "index_head_dim")}
        if min(index.values()) < 1 or hf.index_head_dim < hf.qk_rope_head_dim:
            raise ModelLoadError(f"config.json: DeepSeek-V3.2's indexer settings {index} do not run")
    return MLAConfig(
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        rope_interleave=bool(getattr(hf, "rope_interleave", True)),
        **index,
    )


def _rope_params(hf: Any, layer_type: str | None = None) -> dict[str, Any]:
    """RoPE parameters in one dict, from transformers 5's ``rope_parameters`` (of
    ``layer_type``'s layers where they are given per type: Gemma 3) or the older
    ``rope_theta`` + ``rope_scaling`` pair."""
    params = getattr(hf, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
    elif params:
        params = dict(params)
    else:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.pop("partial_rotary_factor", None)  # ``_rotary_dim``
    return params
