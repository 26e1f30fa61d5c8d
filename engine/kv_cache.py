"""The paged KV cache tensor and its layout.

One tensor per engine::

    cache[layer, k_or_v, block, slot_in_block, kv_head, head_dim]

(a sliding-window model's sliding and full layers share the first dimension's rows
in layer groups, ``KVLayout.grouped``: ``cache[row(layer), ...]`` of its group's blocks)

(an MLA model's cache has one plane per layer, its latent rows, and one "head":
``layout.planes`` is 1), so one block of one layer's K (or V) is a contiguous run of
``block_size * num_kv_heads * head_dim`` elements: the unit a transfer backend
moves, and what it registers once as one memory region. ``KVLayout`` is the
plain-data description the transfer layer needs to check compatibility.

Under tensor parallelism each rank's cache holds only its KV heads:
``num_kv_heads`` counts this rank's heads, which are the model's heads
``[tp_rank * num_kv_heads, (tp_rank + 1) * num_kv_heads)``. With those two
fields a transfer can split or merge heads between workers of different TP
sizes (``splitserve.kv_transfer.tp_mapping``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import sys
import threading

import torch

from splitserve.wire.kv_layout import KVLayout

_HUGE_PAGE = 2 * 2**20


class KVCache:
    """Owns the cache tensor; block ids come from the engine's ``BlockManager``."""

    def __init__(self, layout: KVLayout, device: torch.device):
        self.layout = layout
        self.tensor = allocate_zeros(layout.cache_shape, getattr(torch, layout.dtype), device)
        self.faulting_in = fault_in_background(self.tensor)  # None: nothing to fault in
        # An FP8 cache's scales, [num_layers, 2 (K, V), kv_heads] (engine.kv_quant), set
        # by the engine at start; None otherwise.
        self.scales: torch.Tensor | None = None
        if layout.kv_scales != "none":
            self.scales = torch.ones(layout.num_layers, 2, layout.num_kv_heads, device=device)
        # a hybrid model's linear layers' states (``engine.model.deltanet.DeltaStates``), a
        # row per state slot (``Sequence.state_slot``), views of this tensor's blocks past
        # the first ``kv_blocks`` (``engine.state_blocks``), set by the engine at build
        self.states: list = []
        self.state_plan = None  # their ``StatePlan``
        self.kv_blocks = layout.num_blocks

    def slot_blocks(self, slot: int | None) -> list[int]:
        """The block ids holding state slot ``slot``'s states ([] for None, or a model
        without them): moved with a request's KV blocks."""
        if slot is None or self.state_plan is None:
            return []
        return self.state_plan.slot_blocks(self.kv_blocks, slot)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(k_cache, v_cache) of layer ``i``, each [num_blocks, block_size, kv_heads, head_dim];
        with one plane (MLA) the latent rows and None. In a grouped layout, the blocks of
        the layer's group hold it (``KVLayout.row``)."""
        r = self.layout.row(i)
        return self.tensor[r, 0], (self.tensor[r, 1] if self.layout.planes == 2 else None)

    def scale_values(self) -> tuple[float, ...]:
        """An FP8 cache's scales, flattened [num_layers, 2, kv_heads] (what a handshake
        carries: ``CompatInfo.kv_scales``); () for any other cache."""
        return () if self.scales is None else tuple(self.scales.flatten().tolist())

    def layer_scales(self, i: int) -> torch.Tensor | None:
        """[2, kv_heads]: the K and V scales of layer ``i`` (None: not an FP8 cache)."""
        return None if self.scales is None else self.scales[i]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of the given blocks: [num_layers, planes, len(block_ids), block_size, kv_heads, head_dim]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        return self.tensor.index_select(2, idx)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``; ``data`` must have exactly that shape."""
        expected = (*self.tensor.shape[:2], len(block_ids), *self.tensor.shape[3:])
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        data = data.to(device=self.tensor.device, dtype=self.tensor.dtype)
        if self.tensor.element_size() == 1:  # e4m3: torch copies its bytes, not its values
            self.tensor.view(torch.uint8).index_copy_(2, idx, data.view(torch.uint8))
        else:
            self.tensor.index_copy_(2, idx, data)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: back pages with memory, contents unchanged
_FAULT_IN_BLOCKS = 64  # blocks per step of fault_in_background, at least
_FAULT_IN_BYTES = 4 << 20  # and at least this much of one plane per call


def fault_in_background(cache: torch.Tensor) -> threading.Thread | None:
    """Back the pages of a CPU cache ``[layers, planes, blocks, ...]`` (``allocate_zeros``
    leaves them untouched) with memory, from a thread at the lowest priority, so that
    neither a worker's start nor (once it has run) the serving path pays the page
    faults: an untouched cache cost the first pull of 2,048 tokens' KV into it 200 ms
    here, against 20 ms into pages in memory. Blocks go in order, every layer of a run
    of ``_FAULT_IN_BLOCKS`` blocks (or ``_FAULT_IN_BYTES`` of a plane, if more) at a time
    (the order a fresh engine hands them out): a small model's 1 KiB blocks took
    16,000 calls for 1 GiB, each taking the GIL the engine's threads want.
    ``MADV_POPULATE_WRITE`` leaves a page already written as it is, so it runs beside
    the engine's writes; the thread only yields the CPU to every other thread (nice
    19). Returns the thread, or None: not a CPU tensor on Linux, or too small to have
    been mapped untouched. A kernel without the advice leaves the pages to fault in as
    the cache first writes them."""
    if cache.device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    if cache.numel() * cache.element_size() < 4 * _HUGE_PAGE or cache.dim() < 3:
        return None
    stop = threading.Event()
    thread = threading.Thread(target=_fault_in, args=(cache, stop), name="kv-cache-fault-in", daemon=True)
    thread.start()
    atexit.register(_stop, thread, stop)
    return thread


def _stop(thread: threading.Thread, stop: threading.Event) -> None:
    """At interpreter exit, before daemon threads are frozen: a daemon thread stopped
    inside torch's C++ (waiting for the GIL) unwinds through code that may not
    unwind, and the process aborts ("terminate called without an active exception")."""
    stop.set()
    thread.join()


def _fault_in(cache: torch.Tensor, stop: threading.Event) -> None:
    with contextlib.suppress(OSError):  # the lowest priority, for this thread only (Linux)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    libc = ctypes.CDLL(None, use_errno=True)  # its calls release the GIL
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    planes = cache.flatten(0, 1)  # [layers * planes, blocks, ...]
    block_bytes = planes.stride(1) * cache.element_size()  # a plane's blocks lie one after another
    step = max(_FAULT_IN_BLOCKS, _FAULT_IN_BYTES // block_bytes)
    # every address up front: between two calls (each releases the GIL) the loop holds the
    # GIL for a few integer operations only, not for torch's indexing; at nice 19 a thread
    # holding the GIL may wait long for a core, and every other thread of the process with it
    bases = [plane.data_ptr() for plane in planes]
    for start in range(0, cache.shape[2], step):
        n = min(step, cache.shape[2] - start)
        if stop.is_set():
            return
        for base in bases:
            first = base + start * block_bytes
            aligned = first - first % page  # madvise takes whole pages
            if libc.madvise(aligned, first + n * block_bytes - aligned, _MADV_POPULATE_WRITE) != 0:
                return  # no such advice here (or no memory): the cache faults in as it is written


def allocate_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zeroed contiguous tensor. On a Linux CPU, fresh anonymous memory (zero by
    the kernel's contract) advised to transparent huge pages where the kernel allows
    it (``madvise`` mode), and not touched here: a worker starts without faulting in
    its cache (1 GiB took 1.7-2.2 CPU-seconds here, taken from the workers already
    serving while a new one starts); ``fault_in_background`` does it at idle
    priority. Huge pages make cross-process reads of the cache (NIXL/UCX over cma)
    ~1.6x faster here: 8.3 -> 13.2 GB/s for 755 MB (fewer pages to pin), besides
    fewer TLB misses in attention."""
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < 4 * _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive
    offset = -raw.data_ptr() % _HUGE_PAGE  # a multiple of the (4 KiB) page: madvise takes it
    with contextlib.suppress(OSError, AttributeError):  # no huge pages: ordinary ones are fine too
        memory.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    return raw[offset : offset + nbytes].view(dtype).view(shape)
