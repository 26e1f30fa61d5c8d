"""The KV cache's memory on a Linux CPU: mapped untouched at allocation (a worker
starts without faulting it in), then faulted in by a background thread at idle
priority (``fault_in_background``) while the engine writes it, which keeps every
value written and leaves the rest zero."""

from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys

import pytest
import torch

from splitserve.engine.kv_cache import allocate_zeros, fault_in_background

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory advice")


def resident_share(t: torch.Tensor) -> float:
    """The share of ``t``'s pages in memory (``mincore``)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def test_the_cache_is_faulted_in_behind_the_engine_keeping_what_it_wrote():
    shape = (6, 2, 300, 16, 2, 64)  # [layers, K/V, blocks, slots, heads, dim]: 59 MB of float32
    cache = allocate_zeros(shape, torch.float32)
    assert resident_share(cache) < 0.05  # nothing faulted in at allocation
    writes = {b: torch.randn(shape[0], shape[1], *shape[3:]) for b in (0, 63, 64, 150, 299)}
    thread = fault_in_background(cache)
    for b, values in writes.items():  # the engine writing blocks while the thread runs
        cache[:, :, b] = values
    thread.join(300)
    assert not thread.is_alive()
    assert resident_share(cache) == 1.0
    for b, values in writes.items():
        assert torch.equal(cache[:, :, b], values)
    untouched = torch.ones(shape[2], dtype=torch.bool)
    untouched[list(writes)] = False
    assert not cache[:, :, untouched].any()


def test_nothing_to_fault_in_off_the_cpu_path():
    assert fault_in_background(torch.zeros(4, 2, 8)) is None  # small: never mapped untouched
    assert fault_in_background(torch.zeros(16)) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cache faults in on Linux only")
def test_a_process_exiting_while_its_cache_faults_in_exits_cleanly():
    """The fault-in thread is stopped before the interpreter freezes daemon threads: one
    frozen inside torch's C++ aborted the process ("terminate called without an active
    exception", exit status 134) when a test process ended with a fresh engine."""
    script = (
        "import torch\n"
        "from splitserve.engine.kv_cache import allocate_zeros, fault_in_background\n"
        "cache = allocate_zeros((30, 2, 4096, 16, 8, 64), torch.bfloat16)\n"  # 1.9 GiB, seconds to fault in
        "assert fault_in_background(cache) is not None\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
