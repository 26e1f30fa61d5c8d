"""splitserve.kv_transfer: ship a finished KV cache from a prefill to a decode worker.

The contract (records, lifecycle, who frees what) is in ``splitserve.wire.kv``
(its errors in ``splitserve.wire.errors``); the two
sides every backend implements are ``source.KVSource`` (prefill) and
``sink.KVSink`` (decode). Backends are registered by
name and imported only when chosen::

    backend = get_backend("nixl")
    source = backend.source("prefill-0", engine.kv_cache.tensor, compat, lease_s)  # prefill worker
    sink = backend.sink("decode-0", engine.kv_cache.tensor, compat)        # decode worker
    sink.connect(source.handshake())                                       # once per peer
    desc = source.export(req_id, block_ids, num_tokens)                    # per request
    handoff = KVHandoff("prefill-0", (desc,))                              # what travels
    conf = sink.pull(desc, my_block_ids, timeout=5.0)                      # raises KVTransferError
    ... source.poll() -> [LeaseEnd]: release those blocks in the prefill engine

Layer-wise (``layerwise.LayerExporter`` as the prefill engine's layer observer):
each layer is hashed as prefill writes it, and with ``stream=True`` the
descriptor is published before the forward pass (``source.begin_export``), so
``sink.pull`` moves layers while later ones compute (nixl, local).

| name | moves bytes with | confirms through |
|---|---|---|
| ``nixl`` | NIXL/UCX one-sided READ (DRAM or VRAM; RDMA, NVLink, cma on one host) | NIXL notification |
| ``torch_dist`` | torch.distributed send/recv (gloo on CPU, NCCL on GPU) | a message on the same group |
| ``ucx`` | UCX stream send/recv (ucxx), one endpoint per peer pair; host memory | a message on the pair |
| ``ray`` | the Ray object store (``ray.put`` at export, ``ray.get`` at pull) | the control plane |
| ``local`` | a tensor copy in the same process | a direct call |
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.kv_transfer.sink import KVSink
    from splitserve.kv_transfer.source import KVSource

# name -> (module, source class, sink class); imported lazily so an optional
# library (nixl, ray) is loaded only by the worker that chose it.
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "nixl": ("splitserve.kv_transfer.backends.nixl_backend", "NixlSource", "NixlSink"),
    "torch_dist": ("splitserve.kv_transfer.backends.torch_dist", "TorchDistSource", "TorchDistSink"),
    "ray": ("splitserve.kv_transfer.backends.ray_store", "RaySource", "RaySink"),
    "local": ("splitserve.kv_transfer.backends.local", "LocalSource", "LocalSink"),
    "ucx": ("splitserve.kv_transfer.backends.ucx_backend", "UcxSource", "UcxSink"),
}


# the backends that move KV between processes: what a cluster's transfer.backend may
# name (the config, the benches and the tests take this list); "local" is in-process only
CLUSTER_BACKENDS: tuple[str, ...] = ("nixl", "torch_dist", "ray", "ucx")


@dataclass(frozen=True)
class Backend:
    name: str
    source: type[KVSource]
    sink: type[KVSink]


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``ValueError`` for an unknown name,
    ``ImportError`` (with what to install) if its library is missing."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    module, source, sink = _BACKENDS[name]
    mod = importlib.import_module(module)
    return Backend(name, getattr(mod, source), getattr(mod, sink))


__all__ = ["CLUSTER_BACKENDS", "Backend", "get_backend"]
