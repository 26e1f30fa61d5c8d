"""Pre-quantized checkpoints: what a ``quantization_config`` says, and the FP8
linear that holds such weights.

Two formats, as the FP8 releases ship them::

    quant_method "fp8" (DeepSeek-V3, Qwen3-FP8)       weight F8_E4M3 [out, in]
      weight_block_size [128, 128]                    weight_scale_inv F32 [ceil(out/128), ceil(in/128)]
    quant_method "compressed-tensors" (the FP8        weight F8_E4M3 [out, in]
      re-releases of Llama): weights num_bits 8,      weight_scale F32 [1] (strategy tensor)
      type float, strategy tensor | channel                        or [out, 1] (strategy channel)

``W = weight * scale`` (the block, row or tensor's scale; DeepSeek's "inv" is
the dequantizing multiplier, despite its name). In memory the scale is kept per
row and per block of input columns, ``weight_scale [out, in / block]``
(``in_blocks = 1`` for tensor and channel scales), so that fused q/k/v and
gate/up rows and tensor-parallel row slices need no block alignment; only a
row-parallel layer's column split must fall on block edges.

Every linear of the decoder layers must be FP8 (the embedding and LM head stay
in the model's dtype, as these releases ship them). Static activation scales
(``input_scale``) are not used: activations are quantized per token at run
time, as for the engine's own FP8. Anything else (another method, bit width or
strategy) is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.wire.errors import ModelLoadError


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint's linears are quantized (plain data)."""

    scheme: str  # "block" | "channel" | "tensor"
    block: int = 0  # columns per scale block (scheme "block")

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.scheme == "block" else "weight_scale"

    @classmethod
    def from_config(cls, qc: Any) -> CheckpointQuant | None:
        """Parse a ``quantization_config`` (dict or transformers object); None if absent."""
        if qc is None:
            return None
        if not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        method = qc.get("quant_method")
        if method == "fp8":
            block = qc.get("weight_block_size")
            if not block or len(block) != 2 or block[0] != block[1]:
                raise ModelLoadError(
                    "fp8 checkpoints are supported with a square weight_block_size (e.g. [128, 128]), "
                    f"got {block}"
                )
            if qc.get("activation_scheme", "dynamic") != "dynamic":
                raise ModelLoadError("fp8 checkpoints with static activation scales are not supported")
            return cls("block", int(block[0]))
        if method == "compressed-tensors":
            groups = list((qc.get("config_groups") or {}).values())
            if len(groups) != 1:
                raise ModelLoadError(
                    f"compressed-tensors checkpoints with {len(groups)} config groups are not supported"
                )
            w = groups[0].get("weights") or {}
            if (w.get("num_bits"), w.get("type")) != (8, "float"):
                raise ModelLoadError(
                    f"compressed-tensors weights of {w.get('num_bits')} bits, type {w.get('type')!r} are not "
                    "supported (only FP8: num_bits 8, type float)"
                )
            strategy = w.get("strategy")
            if strategy not in ("tensor", "channel"):
                raise ModelLoadError(
                    f"compressed-tensors FP8 strategy {strategy!r} is not supported (tensor, channel)"
                )
            return cls(strategy)
        raise ModelLoadError(
            f"checkpoint quantization method {method!r} is not supported; splitserve loads fp8 (block-wise) "
            "and compressed-tensors FP8 checkpoints"
        )
