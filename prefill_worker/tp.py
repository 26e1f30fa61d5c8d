"""A prefill worker as a tensor-parallel group: rank 0 is the ``PrefillWorker``
the router talks to; ranks 1.. are ``PrefillRank``s, each a process (a Ray actor
in the same placement group) with its shard of the model, its own KV cache
holding its KV heads, and its own KV source.

Rank 0 drives: every engine step and every message below goes out on the
group's broadcast channel in one order, so the ranks never disagree on what
happened first::

    rank 0 (PrefillWorker)                     rank r (PrefillRank.follow)
    ----------------------                     ---------------------------
    engine.step()        -- StepInputs ------>  forward (collectives pair up)
    request prefilled    -- ExportShard ----->  source.export(same block ids)
      gather <-------------- KVDescriptor ----
    abort / lease ended  -- ReleaseShard ---->  source.release
    confirm (router)     -- ConfirmShard ---->  source.confirm (backends that
                                                confirm through the control plane)
    tick, exports open   -- PollShards ------>  lease ends since the last poll
      gather <-------------- request ids -----
    tick, every timeout/4 -- Heartbeat ------>  (nothing: an idle rank waiting
                                                longer than the group's timeout
                                                would fail its receive)
    shutdown             -- None ------------>  leave the loop, close

A request's blocks (the same ids on every rank: only rank 0 allocates) are
released once the lease ended on *every* rank: a decode worker may still be
reading rank r's shard after rank 0's was confirmed. Decode workers pull all
shards and merge the heads (``splitserve.kv_transfer.tp_mapping``).

Failure: a rank that dies breaks the group's collectives; rank 0's engine loop
then stops and fails every waiting request, and the worker serves nothing more
(the router retries on another prefill worker). The group is not restarted
piecewise.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from splitserve.engine.device import resolve_device
from splitserve.engine.engine import Engine
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.worker_group import Heartbeat, RankFollower, join_group
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.exports import ExportLedger
from splitserve.kv_transfer.tp_mapping import readers_per_rank
from splitserve.wire.errors import InvalidRequest, KVTransferError
from splitserve.wire.kv import Handshake, KVDescriptor
from splitserve.wire.prefill import PrefillWorkerSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportShard:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    readers: tuple[int, ...]  # per rank: decode ranks that read its shard (0: a replica nobody reads)
    window_from: int = 0  # the sliding layers' KV from that block on (wire.kv.KVDescriptor)


@dataclass(frozen=True)
class ReleaseShard:
    request_id: str


@dataclass(frozen=True)
class ConfirmShard:
    transfer_ids: tuple[str, ...]  # a rank confirms those it exported and ignores the rest


@dataclass(frozen=True)
class PollShards:
    pass


class OtherRanks:
    """Rank 0's side of the other ranks' KV shards (the messages above), keeping the
    ``ExportLedger`` in step with them. Engine thread only. In a group of one, every
    call does nothing."""

    def __init__(self, group: TPGroup, ledger: ExportLedger):
        self.group = group
        self.ledger = ledger

    def export(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        readers: tuple[int, ...],
        window_from: int = 0,
    ) -> tuple[KVDescriptor, ...]:
        """Every other rank exports its heads of the same blocks (``readers[r]``: the decode
        ranks that read rank r's); their descriptors in rank order. If one fails, every
        shard is released and ``KVTransferError`` raised (rank 0's own export is the
        caller's to release)."""
        if self.group.size == 1:
            return ()
        self.group.broadcast_object(ExportShard(request_id, block_ids, num_tokens, readers, window_from))
        replies = self.group.gather_object(None)
        failed = next((d for d in replies[1:] if isinstance(d, Exception)), None)
        if failed is not None:
            self.group.broadcast_object(ReleaseShard(request_id))
            raise KVTransferError(str(failed))
        self.ledger.shards_opened(request_id, range(1, self.group.size))
        return tuple(replies[1:])

    def confirm(self, transfer_ids: tuple[str, ...]) -> None:
        self.group.broadcast_object(ConfirmShard(transfer_ids))

    def release(self, request_id: str) -> None:
        """Rank 0's lease of ``request_id`` ended unconfirmed: the others release theirs."""
        if self.group.size > 1:
            self.group.broadcast_object(ReleaseShard(request_id))

    def poll(self) -> None:
        """The other ranks' lease ends since the last poll, into the ledger."""
        if self.ledger.shards_open:
            self.group.broadcast_object(PollShards())
            for rank, ended in enumerate(self.group.gather_object(None)):
                self.ledger.shards_ended(rank, ended or ())


class ReaderCounts:
    """Per rank of a prefill group, how many ranks of a decode group of a given size read
    its export (``readers_per_rank``), kept by that size."""

    def __init__(self, tp_size: int, num_kv_heads: int):
        self._tp_size, self._heads = tp_size, num_kv_heads
        self._by_size: dict[int, tuple[int, ...]] = {}

    def of(self, reader_tp: int) -> tuple[int, ...]:
        """``InvalidRequest`` for a size the model's KV heads do not split over or
        replicate across."""
        readers = self._by_size.get(reader_tp)
        if readers is None:
            try:
                readers = readers_per_rank(self._tp_size, reader_tp, self._heads)
            except ValueError as e:
                raise InvalidRequest(f"no decode group of TP={reader_tp} can take this KV: {e}") from None
            self._by_size[reader_tp] = readers
        return readers


def join_prefill_group(spec: PrefillWorkerSpec) -> TPGroup:
    """Pin and size this process as ``spec`` says, then join its TP group (blocks until
    every rank has joined)."""
    return join_group(spec.tp, resolve_device(spec.engine), spec.cpu_ids, spec.torch_threads)


class PrefillRank:
    """Rank r > 0 of a prefill worker's TP group. Its constructor returns once the
    group has formed and the shard is loaded; a thread then follows rank 0."""

    def __init__(self, spec: PrefillWorkerSpec):
        if spec.tp is None or spec.tp.rank == 0:
            raise ValueError("a PrefillRank is rank 1 or above of a TP group")
        self.spec = spec
        self.group = join_prefill_group(spec)
        self._follower = RankFollower(
            lambda: Engine(spec.engine, tp=self.group),
            self._on_message,
            self._close,
            name=f"{spec.worker_id}/tp{spec.tp.rank}-follow",
        )
        self.engine = self._follower.engine
        compat = self.engine.kv_compat()
        name = f"{spec.worker_id}/tp{spec.tp.rank}"
        self.source = get_backend(spec.backend).source(
            name, self.engine.kv_cache.tensor, compat, spec.lease_s
        )
        self.handshake: Handshake = self.source.handshake()
        self.group.gather_object(self.handshake)  # rank 0 collects every rank's handshake
        self._lock = threading.Lock()  # the source: the follower thread and the poller
        self._ended: set[str] = set()  # request ids whose lease ended, not yet reported
        self._exports: dict[str, str] = {}  # request id -> transfer id
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"{name}-kv-poll", daemon=True)
        self._poller.start()
        self._follower.start()

    async def info(self) -> Handshake:
        return self.handshake

    def wait(self, timeout: float | None = None) -> None:
        """Block until rank 0 stops the group (for a rank hosted outside Ray)."""
        self._follower.join(timeout)

    # ---- threads ----------------------------------------------------------------------
    def _close(self) -> None:  # the follower thread, last
        self._stopping.set()
        self._poller.join(5)
        with self._lock:
            self.source.close()
        self.group.destroy()

    def _on_message(self, msg: object) -> None:
        if isinstance(msg, ExportShard):
            self.group.gather_object(self._export(msg))
        elif isinstance(msg, ReleaseShard):
            with self._lock:
                transfer_id = self._exports.pop(msg.request_id, None)
                if transfer_id is not None:
                    self.source.release(transfer_id)
                self._ended.discard(msg.request_id)
        elif isinstance(msg, ConfirmShard):
            with self._lock:
                for transfer_id in msg.transfer_ids:
                    self.source.confirm(transfer_id)  # the poller reports the lease end
        elif isinstance(msg, Heartbeat):
            pass
        elif isinstance(msg, PollShards):
            with self._lock:
                ended, self._ended = sorted(self._ended), set()
            self.group.gather_object(ended)
        else:
            raise RuntimeError(f"unknown message {type(msg).__name__} from TP rank 0")

    def _export(self, msg: ExportShard) -> KVDescriptor | KVTransferError:
        try:
            with self._lock:
                readers = msg.readers[self.group.rank]
                desc = self.source.export(
                    msg.request_id,
                    msg.block_ids,
                    msg.num_tokens,
                    readers=readers,
                    window_from=msg.window_from,
                )
                self._exports[msg.request_id] = desc.transfer_id
            return desc
        except Exception as e:  # reported to rank 0, which fails the request
            return KVTransferError(f"TP rank {self.group.rank} could not export its KV shard: {e}")

    def _poll(self, interval_s: float = 0.001) -> None:
        while not self._stopping.is_set():
            try:
                with self._lock:
                    for end in self.source.poll():
                        if self._exports.pop(end.request_id, None) is not None:
                            self._ended.add(end.request_id)
            except Exception:
                log.exception("polling the KV source failed")
            time.sleep(interval_s)
