"""The engine's view of a model architecture, read from a Hugging Face config.

One dataclass covers the Llama family: Llama 2/3 (RoPE scaling variants, GQA),
Mistral, Qwen2 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k), and
SmolLM2 (a Llama). Anything outside what the model code implements is refused
here with ``ModelLoadError`` rather than silently computing something else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.model.checkpoint_quant import CheckpointQuant
from splitserve.wire.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a ``transformers.PretrainedConfig``; raise for unsupported features."""
        mt = getattr(hf, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type {mt!r} is not supported; splitserve runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(hf, "mlp_bias", False):
            raise ModelLoadError("MLP bias is not supported")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"activation {hf.hidden_act!r} is not supported (only silu)")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        max_pos = hf.max_position_embeddings
        window = getattr(hf, "sliding_window", None)
        if window and (mt == "mistral" or getattr(hf, "use_sliding_window", False)):
            # Within the window, sliding-window attention equals full attention.
            max_pos = min(max_pos, window)
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or attention_bias,
            o_bias=mt in ("llama", "mistral") and attention_bias,
            qk_norm=mt == "qwen3",
            rope=_rope_params(hf),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
            checkpoint_quant=CheckpointQuant.from_config(getattr(hf, "quantization_config", None)),
        )


def _rope_params(hf: Any) -> dict[str, Any]:
    """RoPE parameters in one dict, from transformers 5's ``rope_parameters`` or
    the older ``rope_theta`` + ``rope_scaling`` pair."""
    params = getattr(hf, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if getattr(hf, "partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial rotary embeddings are not supported")
    return params
