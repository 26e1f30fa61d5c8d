"""What an ``EngineConfig``'s ``device`` and ``dtype`` mean on this machine."""

from __future__ import annotations

import torch

from splitserve.wire.config import EngineConfig


def resolve_device(config: EngineConfig) -> torch.device:
    """``auto`` is the GPU where there is one, else the CPU."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU and on a CPU with native bf16 kernels, else float32."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """True when oneDNN has bf16 kernels for this CPU (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
