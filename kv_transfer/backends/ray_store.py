"""``ray``: the Ray object store, the portable fallback wherever Ray runs.

At export the source packs the blocks into one array and ``ray.put``s it (the
object is owned by the source process and lives until the lease ends); the
descriptor carries the ``ObjectRef``, so it must travel through Ray (actor
calls) for Ray to track the reference. The sink ``ray.get``s it (zero-copy
from the local object store; Ray moves it between nodes) and scatters it
into place. The caller must be connected to Ray (``ray.init``) on both sides.
Confirmations go through the control plane (``Confirmation.delivered`` is
False): the caller forwards them to ``KVSource.confirm``.
"""

from __future__ import annotations

import time
import warnings

import torch

from splitserve.kv_transfer.integrity import pack, unpack
from splitserve.kv_transfer.sink import KVSink
from splitserve.kv_transfer.source import KVSource
from splitserve.wire.errors import KVTransferError, PeerLost, TransferTimeout
from splitserve.wire.kv import CompatInfo, KVDescriptor


class RaySource(KVSource):
    backend = "ray"

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo, lease_s: float):
        super().__init__(worker_id, cache, compat, lease_s)
        self._refs: dict[str, object] = {}  # transfer id -> ObjectRef, dropped when the lease ends

    def _publish(self, desc: KVDescriptor):
        import ray

        layers = range(self.compat.layout.num_layers)
        packed = pack(self.cache, self.compat.layout, desc.block_ids, desc.window_from, layers)
        ref = ray.put(packed.view(torch.uint8).numpy())  # uint8 view: numpy has no bfloat16
        self._refs[desc.transfer_id] = ref
        return ref

    def _unpublish(self, desc: KVDescriptor) -> None:
        self._refs.pop(desc.transfer_id, None)


class RaySink(KVSink):
    backend = "ray"

    def _transfer(self, desc: KVDescriptor, dst_blocks: list[int], deadline: float, layers: range) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            arr = ray.get(desc.payload, timeout=max(deadline - time.monotonic(), 0.001))
        except GetTimeoutError as e:
            raise TransferTimeout(
                f"KV transfer {desc.transfer_id} from {desc.source_worker} timed out"
            ) from e
        except RayError as e:
            raise PeerLost(f"KV of {desc.transfer_id} is lost with {desc.source_worker}: {e}") from e
        with warnings.catch_warnings():  # a read-only view of the object store; it is only read
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(arr).view(self.cache.dtype)
        try:
            unpack(self.cache, self.compat.layout, dst_blocks, desc.window_from, layers, data)
        except ValueError as e:
            raise KVTransferError(f"KV of {desc.transfer_id} from {desc.source_worker}: {e}") from e
