"""KV transfer between workers of different tensor-parallel sizes.

Under TP each rank's cache holds a contiguous range of the model's KV heads
(``KVLayout.kv_head_range``). A decode rank needs, for every block, the heads of
its own range, which may live on one source rank (source TP ≤ destination TP:
heads are split on the way) or several (source TP > destination TP: merged)::

    model KV heads      0 1 2 3 4 5 6 7
    prefill TP=2        [rank 0:0-3][rank 1:4-7]
    decode  TP=1        [rank 0:   0-7         ]   ← merge: both source ranks
    decode  TP=4        [r0][r1][r2][r3]           ← split: r1 takes heads 2-3 of source rank 0

``plan_head_copies`` computes which heads move where (plain data, tested on its
own). ``HeadMappingSink`` runs a plan over any backend without changing it: for
each source rank it needs, it keeps a *staging* cache with exactly that rank's
layout and an ordinary ``KVSink`` over it, so the handshake, the lease, the
checksum and the backend's own failure handling apply unchanged to every
shard; after a shard is verified, its heads are copied into the caller's
blocks. The price is one extra local copy of the pulled bytes, and a split
pulls whole source blocks (all of that rank's heads) to keep some of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.kv_layout import KVLayout
from splitserve.kv_transfer.contract import CompatInfo, Confirmation, Handshake, KVDescriptor
from splitserve.kv_transfer.errors import IncompatiblePeer, PeerLost
from splitserve.kv_transfer.sink import KVSink

# Fields that differ between the shards of one model's KV cache under different TP.
_SHARD_FIELDS = ("num_blocks", "num_kv_heads", "tp_size", "tp_rank")

SinkFactory = Callable[[str, torch.Tensor, CompatInfo], KVSink]


@dataclass(frozen=True)
class HeadCopy:
    """Copy KV heads [src_start, src_stop) of source rank ``src_rank`` (indices local to
    that rank's cache) into heads [dst_start, dst_stop) of the destination cache."""

    src_rank: int
    src_start: int
    src_stop: int
    dst_start: int
    dst_stop: int


def plan_head_copies(src_tp: int, dst: KVLayout) -> list[HeadCopy]:
    """The copies that fill ``dst``'s KV heads from a source group of ``src_tp`` ranks
    holding the same model's heads split evenly. Raises ``ValueError`` if the model's
    heads do not split over ``src_tp``."""
    total = dst.total_kv_heads
    if src_tp < 1 or total % src_tp:
        raise ValueError(f"{total} KV heads do not split over a source TP size of {src_tp}")
    per_src = total // src_tp
    d0, d1 = dst.kv_head_range
    copies = []
    for r in range(src_tp):
        s0, s1 = r * per_src, (r + 1) * per_src
        lo, hi = max(s0, d0), min(s1, d1)
        if lo < hi:
            copies.append(HeadCopy(r, lo - s0, hi - s0, lo - d0, hi - d0))
    return copies


def readers_per_export(src_tp: int, dst_tp: int) -> int:
    """How many decode ranks read each source rank's export (``KVSource.export(readers=...)``):
    one when merging, ``dst_tp / src_tp`` when splitting."""
    return max(1, dst_tp // src_tp)


def shard_layout(layout: KVLayout, tp_size: int, tp_rank: int, num_blocks: int) -> KVLayout:
    """``layout``'s model sharded for rank ``tp_rank`` of ``tp_size``, with ``num_blocks``."""
    if layout.total_kv_heads % tp_size:
        raise ValueError(f"{layout.total_kv_heads} KV heads do not split over TP size {tp_size}")
    return dataclasses.replace(
        layout,
        num_blocks=num_blocks,
        num_kv_heads=layout.total_kv_heads // tp_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def check_same_model(mine: CompatInfo, theirs: CompatInfo, worker: str) -> None:
    """Raise ``IncompatiblePeer`` unless the two caches are shards of the same model's KV."""
    a, b = mine.fields(), theirs.fields()
    diff = [k for k in a if k not in _SHARD_FIELDS and a[k] != b.get(k)]
    if mine.layout.total_kv_heads != theirs.layout.total_kv_heads:
        diff.append("total_kv_heads")
    if diff:
        detail = ", ".join(f"{k}: {b.get(k)!r} there vs {a.get(k)!r} here" for k in diff)
        raise IncompatiblePeer(f"worker {worker} has an incompatible KV cache ({detail})")


class HeadMappingSink:
    """Decode side of a pull from a source TP group of a different size.

    ``connect`` takes the handshakes of all ranks of one source group; ``pull``
    takes their descriptors for one request (one per rank, in rank order) and
    fills ``dst_blocks`` of ``cache`` with this rank's heads. ``max_blocks``
    bounds the blocks of one request (it sizes the staging caches). Errors are
    those of ``KVSink.pull``; on any, ``dst_blocks`` are undefined and the
    caller frees them. Not thread-safe, like ``KVSink``."""

    def __init__(
        self,
        worker_id: str,
        cache: torch.Tensor,
        compat: CompatInfo,
        make_sink: SinkFactory,
        max_blocks: int,
    ):
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.worker_id = worker_id
        self.cache = cache
        self.compat = compat
        self.make_sink = make_sink
        self.max_blocks = max_blocks
        self.src_tp: int | None = None
        self.plan: list[HeadCopy] = []
        self._sinks: dict[int, KVSink] = {}  # source rank -> sink over that rank's staging cache

    def connect(self, handshakes: list[Handshake]) -> None:
        """Check a source group's handshakes (one per rank, any order) and link to the
        ranks this worker needs. Raises ``IncompatiblePeer``."""
        if not handshakes:
            raise ValueError("no handshakes given")
        src_tp = handshakes[0].compat.layout.tp_size
        ranks = sorted(hs.compat.layout.tp_rank for hs in handshakes)
        if any(hs.compat.layout.tp_size != src_tp for hs in handshakes) or ranks != list(range(src_tp)):
            raise IncompatiblePeer(
                f"handshakes do not form one TP group: ranks {ranks} of sizes "
                f"{sorted({hs.compat.layout.tp_size for hs in handshakes})}"
            )
        for hs in handshakes:
            check_same_model(self.compat, hs.compat, hs.worker_id)
        plan = plan_head_copies(src_tp, self.compat.layout)
        by_rank = {hs.compat.layout.tp_rank: hs for hs in handshakes}
        if src_tp != self.src_tp:
            self._close_sinks()
        for copy in plan:
            hs = by_rank[copy.src_rank]
            sink = self._sinks.get(copy.src_rank)
            if sink is None:
                sink = self._sinks[copy.src_rank] = self._staging_sink(hs.compat)
            sink.connect(hs)
        self.src_tp, self.plan = src_tp, plan

    def pull(
        self, descs: list[KVDescriptor], dst_blocks: list[int], timeout: float = 10.0
    ) -> list[Confirmation]:
        """Pull this rank's heads of one request; returns one confirmation per source
        rank pulled from (forward those not ``delivered`` to the source)."""
        if self.src_tp is None:
            raise PeerLost("no source group connected; connect() first")
        if len(descs) != self.src_tp:
            raise ValueError(f"{len(descs)} descriptors given for a source group of {self.src_tp} ranks")
        n = len(dst_blocks)
        if n > self.max_blocks:
            raise ValueError(f"{n} blocks exceed this sink's staging room of {self.max_blocks}")
        dst = torch.tensor(dst_blocks, dtype=torch.long, device=self.cache.device)
        staged = list(range(n))
        confirmations = []
        for copy in self.plan:
            sink = self._sinks[copy.src_rank]
            confirmations.append(sink.pull(descs[copy.src_rank], staged, timeout=timeout))
            heads = sink.cache[:, :, :n, :, copy.src_start : copy.src_stop]
            target = self.cache[:, :, :, :, copy.dst_start : copy.dst_stop]
            target.index_copy_(2, dst, heads)
        return confirmations

    def close(self) -> None:
        self._close_sinks()

    def _staging_sink(self, src: CompatInfo) -> KVSink:
        lay = dataclasses.replace(src.layout, num_blocks=self.max_blocks)
        shape = (lay.num_layers, 2, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
        staging = torch.zeros(shape, dtype=getattr(torch, lay.dtype), device=self.cache.device)
        name = f"{self.worker_id}/tp{lay.tp_rank}of{lay.tp_size}"
        return self.make_sink(name, staging, dataclasses.replace(src, layout=lay))

    def _close_sinks(self) -> None:
        for sink in self._sinks.values():
            sink.close()
        self._sinks.clear()
