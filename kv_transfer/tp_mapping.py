"""KV transfer between workers of different tensor-parallel sizes.

Under TP each rank's cache holds a contiguous range of the model's KV heads
(``KVLayout.kv_head_range``). A decode rank needs, for every block, the heads of
its own range, which may live on one source rank (source TP ≤ destination TP:
heads are split on the way) or several (source TP > destination TP: merged)::

    model KV heads      0 1 2 3 4 5 6 7
    prefill TP=2        [rank 0:0-3][rank 1:4-7]
    decode  TP=1        [rank 0:   0-7         ]   ← merge: both source ranks
    decode  TP=4        [r0][r1][r2][r3]           ← split: r1 takes heads 2-3 of source rank 0

Between groups of one size, rank r reads source rank r whole (no mapping). With
fewer KV heads than ranks, each head lives on several ranks (replicated, as the
model's layers hold them); a destination of another size reads each head from
the lowest rank holding it, and a replica nobody reads is exported with no
readers (its lease ends at once, ``readers_of``)::

    model KV heads      0         1
    prefill TP=4        [r0:0][r1:0][r2:1][r3:1]
    decode  TP=1        [rank 0: 0-1]              ← from r0 and r2; r1 and r3 unread

``plan_head_copies`` computes which heads move where (plain data, tested on its
own). ``HeadMappingSink`` runs a plan over any backend without changing it: for
each source rank it needs, it keeps a *staging* cache with exactly that rank's
layout and an ordinary ``KVSink`` over it, so the handshake, the lease, the
checksum and the backend's own failure handling apply unchanged to every
shard; after a shard is verified, its heads are copied into the caller's
blocks. The price is one extra local copy of the pulled bytes, and a split
pulls whole source blocks (all of that rank's heads) to keep some of them.
``RankSink`` is a decode rank's one entry point: straight into its cache from a
group of its own size, through a ``HeadMappingSink`` from any other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitserve.engine.kv_quant import as_bytes, requantize_ids
from splitserve.kv_transfer.sink import KVSink
from splitserve.wire.errors import IncompatiblePeer, PeerLost
from splitserve.wire.kv import CompatInfo, Confirmation, Handshake, KVDescriptor
from splitserve.wire.kv_layout import KVLayout, kv_head_range

if TYPE_CHECKING:
    from splitserve.engine.state_blocks import StateMapper

# Fields that differ between the shards of one model's KV cache under different TP.
# (``model_kv_heads`` is the same in every shard, but may be left unset: the model's
# KV heads are compared as ``total_kv_heads``.)
_SHARD_FIELDS = ("num_blocks", "num_kv_heads", "tp_size", "tp_rank", "model_kv_heads")

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
    holding the same model's heads (split, or replicated when fewer than the ranks).
    Between groups of one size, rank r reads all of source rank r (they hold the same
    heads); else each head is read from the lowest rank holding it. Raises
    ``ValueError`` if the model's heads neither split over nor replicate across
    ``src_tp``."""
    return _plan(src_tp, dst.total_kv_heads, dst.tp_size, dst.tp_rank)


def readers_of(src_rank: int, src_tp: int, dst_tp: int, total_kv_heads: int) -> int:
    """How many ranks of a destination group of ``dst_tp`` read source rank ``src_rank``'s
    export (``KVSource.export(readers=...)``): 0 for a replica no plan reads."""
    plans = (_plan(src_tp, total_kv_heads, dst_tp, r) for r in range(dst_tp))
    return sum(any(c.src_rank == src_rank for c in plan) for plan in plans)


def readers_per_rank(src_tp: int, dst_tp: int, total_kv_heads: int) -> tuple[int, ...]:
    """``readers_of`` for every rank of a source group of ``src_tp``: each KV head is read
    once per destination rank holding it, from the lowest source rank that holds it.
    ``ValueError`` for a size the heads do not split over or replicate across."""
    if dst_tp < 1:
        raise ValueError(f"a reader TP size must be >= 1, got {dst_tp}")
    return tuple(readers_of(r, src_tp, dst_tp, total_kv_heads) for r in range(src_tp))


def _plan(src_tp: int, total: int, dst_tp: int, dst_rank: int) -> list[HeadCopy]:
    """``plan_head_copies`` for rank ``dst_rank`` of a destination group of ``dst_tp``."""
    if src_tp < 1:
        raise ValueError(f"a source TP size must be >= 1, got {src_tp}")
    d0, d1 = kv_head_range(total, dst_tp, dst_rank)
    ranges = [kv_head_range(total, src_tp, r) for r in range(src_tp)]
    if src_tp == dst_tp:
        return [HeadCopy(dst_rank, 0, d1 - d0, 0, d1 - d0)]
    copies: list[HeadCopy] = []
    for head in range(d0, d1):
        rank = next(r for r, (s0, s1) in enumerate(ranges) if s0 <= head < s1)
        s0 = ranges[rank][0]
        last = copies[-1] if copies else None
        if last is not None and last.src_rank == rank and last.src_stop == head - s0:
            copies[-1] = dataclasses.replace(last, src_stop=head - s0 + 1, dst_stop=head - d0 + 1)
        else:
            copies.append(HeadCopy(rank, head - s0, head - s0 + 1, head - d0, head - d0 + 1))
    return copies


def shard_layout(layout: KVLayout, tp_size: int, tp_rank: int, num_blocks: int) -> KVLayout:
    """``layout``'s model sharded for rank ``tp_rank`` of ``tp_size``, with ``num_blocks``."""
    total = layout.total_kv_heads
    k0, k1 = kv_head_range(total, tp_size, tp_rank)
    return dataclasses.replace(
        layout,
        num_blocks=num_blocks,
        num_kv_heads=k1 - k0,
        tp_size=tp_size,
        tp_rank=tp_rank,
        model_kv_heads=total,
    )


def kv_scales(compat: CompatInfo, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """An FP8 cache's scales as ``[num_layers, 2, num_kv_heads]`` (None for any other)."""
    if not compat.kv_scales:
        return None
    lay = compat.layout
    flat = torch.tensor(compat.kv_scales, dtype=torch.float32, device=device)
    return flat.view(lay.num_layers, 2, lay.num_kv_heads)


def check_same_model(mine: CompatInfo, theirs: CompatInfo, worker: str) -> None:
    """Raise ``IncompatiblePeer`` unless the two caches are shards of the same model's KV
    (a hybrid model's state blocks differ by shard too: both have them, or neither)."""
    a, b = mine.fields(), theirs.fields()
    diff = [k for k in a if k not in (*_SHARD_FIELDS, "states") and a[k] != b.get(k)]
    if bool(a["states"]) != bool(b.get("states")):
        diff.append("states")
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
    bounds the blocks of one request (it sizes the staging caches). With ``states``
    (a hybrid model's ``engine.state_blocks.StateMapper``) the last
    ``states.blocks_per_slot`` of ``dst_blocks`` are the request's state slot: the
    source ranks' slots (the last blocks of their descriptors, of their own number)
    are staged whole and this rank's heads' states rebuilt from them, not
    head-copied. Errors are those of ``KVSink.pull``; on any, ``dst_blocks`` are
    undefined and the caller frees them. Not thread-safe, like ``KVSink``."""

    def __init__(
        self,
        worker_id: str,
        cache: torch.Tensor,
        compat: CompatInfo,
        make_sink: SinkFactory,
        max_blocks: int,
        states: StateMapper | None = None,
    ):
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.states = states  # a hybrid model's: rebuilds the states from the source ranks'
        self.worker_id = worker_id
        self.cache = as_bytes(cache)
        self.compat = compat
        self.make_sink = make_sink
        self.max_blocks = max_blocks
        # an FP8 cache's own scales, which what it pulls is rescaled into
        self.scales = kv_scales(compat, cache.device)
        self._src_scales: dict[int, torch.Tensor | None] = {}  # source rank -> its scales
        self.src_tp: int | None = None
        self.plan: list[HeadCopy] = []
        self.last_wait_s = 0.0  # the last pull's seconds waiting for a streamed source's layers
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
        if self.states is not None and len({c.src_rank for c in plan}) < src_tp:
            raise IncompatiblePeer(
                f"worker {handshakes[0].worker_id}: a hybrid model's states on {src_tp} ranks whose KV "
                f"heads are replicas cannot be rebuilt on {self.compat.layout.tp_size}"
            )
        by_rank = {hs.compat.layout.tp_rank: hs for hs in handshakes}
        if src_tp != self.src_tp:
            self._close_sinks()
        for copy in plan:
            hs = by_rank[copy.src_rank]
            sink = self._sinks.get(copy.src_rank)
            if sink is None:
                sink = self._sinks[copy.src_rank] = self._staging_sink(hs.compat)
            sink.connect(hs)
            self._src_scales[copy.src_rank] = kv_scales(hs.compat, self.cache.device)
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
        # a hybrid model's last blocks are a state slot: rebuilt, not head-copied (the
        # source ranks' slots may have another number of blocks)
        n = len(dst_blocks) - (self.states.blocks_per_slot if self.states is not None else 0)
        most = max(len(d.block_ids) for d in descs)
        if most > self.max_blocks:
            raise ValueError(f"{most} blocks exceed this sink's staging room of {self.max_blocks}")
        dst = torch.tensor(dst_blocks[:n], dtype=torch.long, device=self.cache.device)
        confirmations = []
        self.last_wait_s = 0.0
        for copy in self.plan:
            sink = self._sinks[copy.src_rank]
            staged = list(range(len(descs[copy.src_rank].block_ids)))
            confirmations.append(sink.pull(descs[copy.src_rank], staged, timeout=timeout))
            self.last_wait_s += sink.last_stats.wait_s
            src_heads, dst_heads = slice(copy.src_start, copy.src_stop), slice(copy.dst_start, copy.dst_stop)
            self.cache[:, :, :, :, dst_heads].index_copy_(2, dst, sink.cache[:, :, :n, :, src_heads])
            src_scales = self._src_scales[copy.src_rank]
            if self.scales is not None and src_scales is not None:
                requantize_ids(
                    self.cache,
                    self.compat.layout,
                    dst_blocks[:n],
                    descs[copy.src_rank].window_from,
                    dst_heads,
                    src_scales[:, :, src_heads],
                    self.scales[:, :, dst_heads],
                )
        if self.states is not None:
            staged_by_rank = {r: (sink.cache, sink.compat.layout) for r, sink in self._sinks.items()}
            self.states.copy(staged_by_rank, n, self.cache, dst_blocks[n:])
        return confirmations

    def close(self) -> None:
        self._close_sinks()

    def _staging_sink(self, src: CompatInfo) -> KVSink:
        lay = dataclasses.replace(src.layout, num_blocks=self.max_blocks)
        staging = torch.zeros(lay.cache_shape, dtype=getattr(torch, lay.dtype), device=self.cache.device)
        name = f"{self.worker_id}/tp{lay.tp_rank}of{lay.tp_size}"
        return self.make_sink(name, staging, dataclasses.replace(src, layout=lay))

    def _close_sinks(self) -> None:
        for sink in self._sinks.values():
            sink.close()
        self._sinks.clear()


class RankSink:
    """The decode side of one TP rank (of a group of any size, 1 included): pulls its KV
    heads of a request from a source group of any size.

    From a group of this rank's own size it reads source rank r's export straight
    into its cache with one ``KVSink`` (shared by all such sources: the layouts
    match); from any other through a ``HeadMappingSink`` per source group, keyed by
    the source's worker id (its rank 0's). An FP8 cache rescales the heads it pulled
    from the source's scales (its handshake's) into its own (``kv_quant.requantize``),
    after their checksums were verified. Not thread-safe, like ``KVSink``."""

    def __init__(
        self,
        worker_id: str,
        cache: torch.Tensor,
        compat: CompatInfo,
        make_sink: SinkFactory,
        max_blocks: int,
        states: StateMapper | None = None,
    ):
        self.states = states  # a hybrid model's (``HeadMappingSink``)
        self.worker_id = worker_id
        self.cache = cache
        self.compat = compat
        self.make_sink = make_sink
        self.max_blocks = max_blocks  # one request's blocks at most (it sizes staging caches)
        self.direct = make_sink(worker_id, cache, compat)
        # an FP8 cache's own scales, which what it pulls is rescaled into
        self.scales = kv_scales(compat, cache.device)
        self._direct_scales: dict[str, torch.Tensor | None] = {}  # source rank's worker id -> its scales
        self._mapped: dict[str, HeadMappingSink] = {}  # source worker -> its head-mapping sink

    def connect(self, handshakes: list[Handshake]) -> None:
        """Link to a source group: its handshakes, one per rank, any order (a source of
        TP=1 has one). A restarted source's new handshakes replace the old ones. Raises
        ``IncompatiblePeer``."""
        if not handshakes:
            raise ValueError("no handshakes given")
        handshakes = sorted(handshakes, key=lambda hs: hs.compat.layout.tp_rank)
        source = handshakes[0].worker_id  # its rank 0's, as its descriptors name it
        me = self.compat.layout
        if len(handshakes) == me.tp_size:
            peer = handshakes[me.tp_rank]
            self.direct.connect(peer)
            self._direct_scales[peer.worker_id] = kv_scales(peer.compat, self.cache.device)
            mapped = self._mapped.pop(source, None)
            if mapped is not None:
                mapped.close()
            return
        if me.states and self.states is None:  # its state blocks are not laid out by KV heads
            raise IncompatiblePeer(
                f"worker {source} runs this hybrid model on {len(handshakes)} TP ranks, this one on "
                f"{me.tp_size}: its linear layers' states move only between groups of the same size"
            )
        mapped = self._mapped.get(source)
        if mapped is None:
            name = f"{self.worker_id}<{source}"
            mapped = self._mapped[source] = HeadMappingSink(
                name, self.cache, self.compat, self.make_sink, self.max_blocks, self.states
            )
        mapped.connect(list(handshakes))

    def pull(
        self, descs: tuple[KVDescriptor, ...], dst_blocks: list[int], timeout: float
    ) -> tuple[list[Confirmation], float]:
        """Pull this rank's heads of one request (``descs``: the handoff's, one per source
        rank) into ``dst_blocks``. Returns the confirmations (forward those not
        ``delivered`` to the source) and the seconds spent waiting for a streamed
        source's layers. Errors are ``KVSink.pull``'s; on any, ``dst_blocks`` are
        undefined and the caller frees them (it owns them; this never frees blocks)."""
        me = self.compat.layout
        if len(descs) == me.tp_size:
            desc = descs[me.tp_rank]
            confirmation = self.direct.pull(desc, dst_blocks, timeout)
            src_scales = self._direct_scales.get(desc.source_worker)
            if self.scales is not None and src_scales is not None:
                lay = self.direct.compat.layout
                requantize_ids(
                    self.direct.cache, lay, dst_blocks, desc.window_from, slice(None), src_scales, self.scales
                )
            return [confirmation], self.direct.last_stats.wait_s
        mapped = self._mapped.get(descs[0].source_worker)
        if mapped is None:
            raise PeerLost(f"not linked to source group {descs[0].source_worker}; connect() first")
        return mapped.pull(list(descs), dst_blocks, timeout), mapped.last_wait_s

    def maps(self, source_worker: str) -> bool:
        """Whether pulls from that source group go through staging (it has another size)."""
        return source_worker in self._mapped

    def close(self) -> None:
        self.direct.close()
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
