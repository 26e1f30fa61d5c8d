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
    """True when this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16), where bf16
    matmuls beat float32's. oneDNN also "supports" bf16 on plain AVX-512 by converting,
    and there it is about 4x slower than float32 (a 32 x 576 x 1536 matmul: 1.6 ms in
    bf16, 0.4 ms in float32 on a Xeon without AVX512-BF16), so its own check is not
    enough: the CPU's flags decide where they can be read (Linux), else oneDNN's check."""
    flags = _cpu_flags()
    if flags is not None:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags (``/proc/cpuinfo``), or None where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None
