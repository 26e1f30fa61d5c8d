"""Rotary position embeddings with the scaling variants Llama-family configs use.

``inv_freq`` follows the published definitions (default, linear, llama3, yarn),
and the model applies RoPE in the "rotate half" layout of Hugging Face checkpoints
(GGUF files are converted to it by transformers when loaded).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from splitserve.wire.errors import ModelLoadError


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def rope_inv_freq(head_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [head_dim/2], attention_scaling)`` for a RoPE config."""
    kind = params.get("rope_type", "default")
    base = float(params.get("rope_theta", 10000.0))
    inv_freq = _default_inv_freq(base, head_dim)
    if kind == "default":
        return inv_freq, 1.0
    factor = float(params["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, factor, params), 1.0
    if kind == "yarn":
        return _yarn(base, head_dim, factor, params, max_position)
    raise ModelLoadError(f"RoPE scaling type {kind!r} is not supported (default, linear, llama3, yarn)")


def _llama3(inv_freq: torch.Tensor, factor: float, p: dict[str, Any]) -> torch.Tensor:
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``scale`` times."""
    return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0


def _yarn(base: float, dim: int, factor: float, p: dict[str, Any], max_position: int):
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        if m and m_all:
            attention_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)
    original = p.get("original_max_position_embeddings") or max_position

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(original / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position, computed in float32 on
    the CPU whatever the default device (under ``torch.device("meta")``, where a model
    is declared, meta arithmetic would import torch's compiler stack: a second of every
    worker's start); ``.to`` puts them where the model runs."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position: int):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(head_dim, params, max_position)
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for the given positions, computed once per step."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; where the tables are narrower than a head (partial
    rotary: GLM), its leading dimensions turn and the rest pass through."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
