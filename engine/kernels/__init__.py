"""splitserve's kernels. On CUDA: the Triton set in ``cuda.py`` (``load_cuda()``,
None where triton does not import). On CPU, below: native kernels (paged decode and
prefill attention, fused residual-add + RMSNorm, and for bf16 fused rotary + KV
write and SiLU·up; ``cpu_model_kernels`` picks the model's share for a dtype),
compiled from ``csrc/`` on first use with
``torch.utils.cpp_extension`` (gcc; cached in torch's extensions directory, so
only the first start of a machine pays the ~30 s build; ``-march=native``, so
the cache belongs to the machine that built it). If the build fails, callers
fall back to pure torch (SDPA attention, torch norms); ``load()`` returns None
then and logs why once."""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("bindings.cpp", "paged_decode.cpp", "paged_prefill.cpp", "elementwise.cpp")
]


def _ensure_ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH. The ``ninja`` wheel puts it
    next to the interpreter, which is not on PATH when a virtualenv's script is run
    without activating it; add the wheel's own bin directory for this process."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load as load_extension

        _ensure_ninja_on_path()
        log.info("loading native CPU kernels (compiled once on first use: about half a minute)")

        return load_extension(
            name="splitserve_cpu_kernels",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # a compiler problem of any kind: fall back, say so once
        log.warning("CPU attention kernels unavailable (%s); using the SDPA path", e)
        return None


@functools.cache
def load_cuda() -> ModuleType | None:
    """The Triton kernels for CUDA (``splitserve.engine.kernels.cuda``), or None, said
    once, where triton does not import (callers then use torch's ops)."""
    try:
        from splitserve.engine.kernels import cuda
    except ImportError as e:
        log.warning("Triton kernels unavailable (%s); using torch's ops on CUDA", e)
        return None
    return cuda


@dataclass(frozen=True)
class CpuModelKernels:
    """The fused kernels a CPU model takes (``DecoderModel.use_kernels``): the norm for
    every dtype; rotary + KV write and SiLU·up where they apply (bf16, built with
    AVX-512, a head size that is a multiple of 32 and an intermediate size that is a
    multiple of 16),
    else None and the model runs torch's ops for those."""

    add_rms_norm: Callable
    rope_and_cache: Callable | None
    silu_mul: Callable | None


def cpu_model_kernels(dtype: torch.dtype, head_dim: int, intermediate_size: int) -> CpuModelKernels | None:
    """The native kernels for a CPU model of this dtype and shape, or None when they
    did not build."""
    native = load()
    if native is None:
        return None
    bf16 = dtype == torch.bfloat16 and native.has_fused_bf16()
    return CpuModelKernels(
        add_rms_norm=native.add_rms_norm,
        rope_and_cache=native.rope_and_cache if bf16 and head_dim % 32 == 0 else None,
        silu_mul=native.silu_mul if bf16 and intermediate_size % 16 == 0 else None,
    )
