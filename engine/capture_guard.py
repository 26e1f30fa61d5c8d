"""What a CUDA graph capture refuses, caught where there is no GPU.

A capture fails (or, worse, records a stale value) when the captured code reads a
tensor's value on the host (``item``, ``tolist``, ``int(t)``, ``bool(t)``) or runs an
op whose output shape depends on tensor values (``nonzero``, boolean indexing,
``bincount``, ``unique``, ``repeat_interleave`` with tensor repeats). On the CPU those
are legal and fast, so a path that will be captured on a GPU can break there
unnoticed. ``refuse_host_syncs`` makes them raise ``HostSync`` inside a block: the
off-CUDA recorder of ``cuda_graphs`` runs each recording's step once under it, so
the unit tests that record decode graphs with Triton's interpreter catch what a
capture would refuse.

It sees what passes through torch's dispatcher, plus ``Tensor.tolist`` (which reads
CPU memory without dispatching). It cannot see a host-to-device copy of a Python list
(``torch.tensor(list, device=...)``), which is a copy on the CPU; ``tests/gpu``
captures for real.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops that read a value on the host, or whose output shape depends on values
_REFUSED = {
    aten._local_scalar_dense.default: "reads a tensor's value on the host (item, int(), bool())",
    aten.nonzero.default: "nonzero: its output shape depends on values",
    aten.bincount.default: "bincount: its output length depends on the largest value",
    aten.masked_select.default: "masked_select: its output shape depends on values",
    aten.repeat_interleave.Tensor: "repeat_interleave by a tensor: its output shape depends on values",
    aten._unique2.default: "unique: its output shape depends on values",
    aten.unique_consecutive.default: "unique_consecutive: its output shape depends on values",
    aten.unique_dim.default: "unique: its output shape depends on values",
}


class HostSync(RuntimeError):
    """An op a CUDA graph capture refuses ran inside ``refuse_host_syncs``."""


class _Refuse(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        why = _REFUSED.get(func)
        if why is None and func is aten.index.Tensor:
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                why = "boolean indexing: its output shape depends on values"
        if why is not None:
            raise HostSync(f"{func}: {why}; a CUDA graph cannot capture it")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def refuse_host_syncs() -> Iterator[None]:
    """Inside the block, what a CUDA graph capture refuses raises ``HostSync`` on this
    thread (the dispatch mode is per thread; ``tolist``, patched on the class while
    the block runs, refuses only this thread's calls). Not reentrant across threads:
    one block at a time in a process."""
    original = torch.Tensor.tolist
    owner = threading.get_ident()

    def tolist(self, *args, **kwargs):
        if threading.get_ident() != owner:
            return original(self, *args, **kwargs)
        raise HostSync("Tensor.tolist: reads a tensor's values on the host; a CUDA graph cannot capture it")

    torch.Tensor.tolist = tolist
    try:
        with _Refuse():
            yield
    finally:
        torch.Tensor.tolist = original
