"""splitserve's kernels. On CUDA: the Triton set in ``cuda.py`` (``load_cuda()``,
None where triton does not import). On CPU, below: native kernels (paged decode and
prefill attention, fused residual-add + RMSNorm, and for bf16 fused rotary + KV
write and SiLU·up; ``cpu_model_kernels`` picks the model's share for a dtype),
compiled from ``csrc/`` on first use with
``torch.utils.cpp_extension`` (gcc; cached in torch's extensions directory, so
only the first start of a machine pays the ~30 s build; ``-march=native``, so
the cache belongs to the machine that built it). If the build fails, callers
fall back to pure torch (SDPA attention, torch norms); ``load()`` returns None
then and logs why once.

The build never waits forever: it goes into a directory named by a digest of its
sources, flags, torch, Python, the CPU's features and the ninja that runs it (two
checkouts of different kernels never share one, nor rebuild each other's, nor do two
kinds of CPU, nor two ninjas, whose logs each take the other's for stale), and
processes building it take turns under an ``flock`` that the kernel releases when
its holder dies. torch's own ``lock`` file there is left behind by a builder that
was killed, and every later build would wait on it without end; under the ``flock``
no one else is building, so one found there is stale and removed. A turn not had
within ``BUILD_WAIT_S`` falls back as a failed build does."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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


_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only")
_LDFLAGS = ("-fopenmp",)
BUILD_WAIT_S = 900.0  # the longest a process waits for another's build of the kernels


def _cpu_features() -> str:
    """The CPU's feature flags (Linux's ``/proc/cpuinfo``), which ``-march=native``
    compiles for: a build directory shared by machines of other CPUs (a home directory
    on NFS) must not hand one of them instructions it lacks."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _ninja_version() -> str:
    """The version of the ``ninja`` on PATH, which torch's builder runs ("" if none).
    Two versions keep incompatible logs (1.11's v5, 1.12's v7 hash commands differently),
    so each takes the other's objects for stale and rebuilds them all: a process started
    from an activated virtualenv (the ``ninja`` wheel) and one started without (a
    system ninja) would rebuild the kernels in turn, each holding the build for a
    minute and a half while the other's workers wait."""
    path = shutil.which("ninja")
    return "" if path is None else _version_of(path)


@functools.cache
def _version_of(ninja: str) -> str:
    try:
        return subprocess.run([ninja, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def build_directory() -> Path:
    """Where this checkout's kernels are built: torch's extensions root
    (``TORCH_EXTENSIONS_DIR`` if set), in a directory named by a digest of what the
    build depends on (sources, flags, torch, Python, the CPU's features, the ninja on
    PATH). Puts the ``ninja`` wheel's on this process's PATH first if PATH has none, so
    the ninja named is the one the build runs."""
    from torch.utils.cpp_extension import get_default_build_root

    _ensure_ninja_on_path()
    digest = hashlib.sha256()
    parts = (torch.__version__, sys.version, platform.machine(), _cpu_features(), _ninja_version())
    parts += _CFLAGS + _LDFLAGS
    for part in parts:
        digest.update(part.encode() + b"\0")
    for path in _SOURCES:
        digest.update(path.read_bytes())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch reads it
    return Path(root) / f"splitserve_cpu_kernels-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def build_turn(directory: Path, wait_s: float) -> Iterator[None]:
    """Hold the build of ``directory`` for this process (an ``flock``, released by the
    kernel if the process dies), waiting up to ``wait_s`` for another's turn to end
    (``TimeoutError`` then); torch's ``lock`` file found there is a dead builder's and
    is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "splitserve.flock", "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has built the kernels in {directory} for over {wait_s:.0f} s"
                    ) from None
                time.sleep(0.2)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def load() -> ModuleType | None:
    """The native CPU kernels, built here if this machine has not built them yet; None
    (said once) if they do not build or another process's build of them has not ended
    within ``BUILD_WAIT_S``. Once per process."""
    try:
        from torch.utils.cpp_extension import load as load_extension

        log.info("loading native CPU kernels (compiled once on first use: about half a minute)")
        directory = build_directory()
        with build_turn(directory, BUILD_WAIT_S):
            return load_extension(
                name="splitserve_cpu_kernels",
                sources=[str(p) for p in _SOURCES],
                extra_cflags=list(_CFLAGS),  # lists torch appends to
                extra_ldflags=list(_LDFLAGS),
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as e:  # a compiler problem of any kind, a turn not had: fall back, say so once
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
