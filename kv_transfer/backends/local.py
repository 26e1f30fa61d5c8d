"""``local``: same-process hand-over (colocated mode, unit tests).

Sources register in a ``LocalHub`` that both sides are given; a sink copies
blocks straight out of the source's cache tensor (a chunk of layers at a time),
reads a streamed export's progress straight off the source's board, and
confirms by calling the source. No serialization, no second process; the sink
may run on another thread than the source's (e.g. pulling while the source's
engine computes later layers).
"""

from __future__ import annotations

import time

import torch

from splitserve.kv_transfer.integrity import paired_runs
from splitserve.kv_transfer.progress import parse_row
from splitserve.kv_transfer.sink import KVSink
from splitserve.kv_transfer.source import KVSource
from splitserve.wire.errors import LeaseExpired, PeerLost, TransferTimeout
from splitserve.wire.kv import CompatInfo, Handshake, KVDescriptor, LayerProgress


class LocalHub:
    """The in-process directory of local sources, passed explicitly to both sides."""

    def __init__(self) -> None:
        self.sources: dict[str, LocalSource] = {}


class LocalSource(KVSource):
    backend = "local"
    streams = True

    def __init__(
        self,
        worker_id: str,
        cache: torch.Tensor,
        compat: CompatInfo,
        lease_s: float,
        *,
        hub: LocalHub,
    ):
        super().__init__(worker_id, cache, compat, lease_s)
        self.hub = hub
        hub.sources[worker_id] = self

    def close(self) -> None:
        super().close()
        if self.hub.sources.get(self.worker_id) is self:
            del self.hub.sources[self.worker_id]


class LocalSink(KVSink):
    backend = "local"
    chunked = True

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo, *, hub: LocalHub):
        super().__init__(worker_id, cache, compat)
        self.hub = hub

    def _source(self, desc: KVDescriptor) -> LocalSource:
        src = self.hub.sources.get(desc.source_worker)
        if src is None or src.incarnation != desc.source_incarnation:
            raise PeerLost(f"local worker {desc.source_worker} is gone")
        return src

    def _connect(self, hs: Handshake, replacing: Handshake | None) -> None:
        if hs.worker_id not in self.hub.sources:
            raise PeerLost(f"local worker {hs.worker_id} is not in this process")

    def _transfer(self, desc: KVDescriptor, dst_blocks: list[int], deadline: float, layers: range) -> None:
        src = self._source(desc)
        if not src._is_live(desc.transfer_id):
            raise LeaseExpired(f"transfer {desc.transfer_id} is no longer exported")
        lay = self.compat.layout
        for lo, hi, start, stop in lay.layer_runs(layers, len(dst_blocks), desc.window_from):
            r0, r1 = lay.row(lo), lay.row(lo) + hi - lo
            for s, d, n in paired_runs(desc.block_ids[start:stop], dst_blocks[start:stop]):
                self.cache[r0:r1, :, d : d + n].copy_(src.cache[r0:r1, :, s : s + n], non_blocking=True)
        if time.monotonic() > deadline:
            raise TransferTimeout(f"local copy of {desc.transfer_id} overran its deadline")

    def _progress(self, desc: KVDescriptor, deadline: float) -> LayerProgress:
        row = self._source(desc).board.tensor[desc.stream.slot].tolist()
        return parse_row(row, desc.stream, desc.transfer_id)

    def _confirm(self, desc: KVDescriptor) -> bool:
        self._source(desc).confirm(desc.transfer_id)
        return True
