"""Attention backends, chosen by name or automatically: on CUDA flash-attn when it
imports, else the Triton paged-decode kernel; on CPU the native paged-decode kernel
when it builds; SDPA otherwise.
Backends load lazily so an absent native package costs nothing."""

from __future__ import annotations

import importlib

import torch

from splitserve.engine.attention.base import AttentionBackend, SeqSpan

_BACKENDS = {
    "sdpa": ("splitserve.engine.attention.sdpa", "SdpaBackend"),
    "flash_attn": ("splitserve.engine.attention.flash_attn", "FlashAttnBackend"),
    "cpu": ("splitserve.engine.attention.cpu", "CpuBackend"),
    "triton": ("splitserve.engine.attention.triton", "TritonBackend"),
}


def flash_attn_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def get_backend(name: str, device: torch.device, native_kernels: bool = True) -> AttentionBackend:
    """``name`` is "auto", "sdpa", "cpu", "triton" or "flash_attn"; "auto" picks "cpu"
    on CPU only with ``native_kernels``, and on CUDA "flash_attn" if it imports, else
    "triton" (whose decode steps CUDA graphs can capture)."""
    if name == "auto":
        if device.type == "cpu" and not native_kernels:
            name = "sdpa"
        elif device.type == "cpu":
            from splitserve.engine import kernels

            name = "cpu" if kernels.load() is not None else "sdpa"
        else:
            name = "flash_attn" if flash_attn_available(device) else "triton"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    backend_cls = getattr(importlib.import_module(module), cls)
    return backend_cls(device) if name == "triton" else backend_cls()


__all__ = ["AttentionBackend", "SeqSpan", "get_backend", "flash_attn_available"]
