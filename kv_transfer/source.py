"""``KVSource``: the prefill side of a transfer. Exports blocks, holds them under
leases, serves reads, and reports every lease that ended (see
``wire.kv`` for the lifecycle and who frees what). Not
thread-safe: one thread at a time drives a source."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass

import torch

from splitserve.engine.kv_quant import as_bytes
from splitserve.kv_transfer import integrity
from splitserve.kv_transfer.progress import ProgressBoard
from splitserve.wire.kv import (
    PROTOCOL_VERSION,
    CompatInfo,
    Handshake,
    KVDescriptor,
    LeaseEnd,
    StreamSlot,
    TransferState,
    check_transition,
)

log = logging.getLogger(__name__)


@dataclass
class _Export:
    descriptor: KVDescriptor
    state: TransferState
    confirmations_left: int = 1


class KVSource:
    """Prefill side: exports blocks, holds them under leases, serves reads.

    Subclasses implement ``_publish`` (make a transfer readable; may return a
    descriptor payload), ``_unpublish`` and ``_progress`` (drive the backend and
    return the transfer ids confirmed through its channel). A backend whose
    sinks can read ``board`` sets ``streams`` (then ``begin_export`` works)."""

    backend = ""
    streams = False  # whether sinks of this backend can follow a streamed export
    STREAM_SLOTS = 256  # streamed exports open at once; past it, stream nothing new

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo, lease_s: float):
        integrity.check_cache(cache, compat)
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex
        self.cache = as_bytes(cache)  # an FP8 cache moves as bytes
        self.compat = compat
        self.lease_s = lease_s
        self._exports: dict[str, _Export] = {}
        self._ended: list[LeaseEnd] = []
        self.board = ProgressBoard(compat.layout.num_layers, self.STREAM_SLOTS) if self.streams else None

    # ---- control plane ------------------------------------------------------
    def handshake(self) -> Handshake:
        return Handshake(
            PROTOCOL_VERSION, self.backend, self.worker_id, self.incarnation, self.compat, self._payload()
        )

    @property
    def holds_exports(self) -> bool:
        """Whether any export's lease is still open (its blocks held for a reader), or
        ended without ``poll`` having reported it yet."""
        return bool(self._exports or self._ended)

    def export(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        lease_s: float | None = None,
        readers: int = 1,
        layer_checksums: tuple[int, ...] | None = None,
        window_from: int = 0,
    ) -> KVDescriptor:
        """Start a lease and make the blocks readable. The caller must not write to or
        free ``block_ids`` until ``poll`` returns this transfer's ``LeaseEnd``.
        ``layer_checksums`` are the blocks' per-layer checksums if the caller took
        them while prefill wrote the KV; without them the blocks are hashed here.
        ``window_from``: the sliding layers' KV moves only from that block on
        (``KVDescriptor.window_from``; their checksums cover those blocks).
        The lease is confirmed once ``readers`` sinks have each confirmed it (more than
        one when decode ranks of a larger TP group each take some of its KV heads; none
        for a replica of KV heads another rank serves: its lease ends, confirmed, at
        once, and its descriptor, kept for the handoff's rank order, counts no bytes)."""
        self._check_window(block_ids, window_from)
        if layer_checksums is None:
            layer_checksums = integrity.layer_checksums(
                self.cache, block_ids, self.compat.layout, window_from
            )
        if len(layer_checksums) != self.compat.layout.num_layers:
            raise ValueError(
                f"{len(layer_checksums)} layer checksums for {self.compat.layout.num_layers} layers"
            )
        return self._start(
            request_id, block_ids, num_tokens, lease_s, readers, tuple(layer_checksums), None, window_from
        )

    def can_stream(self) -> bool:
        """Whether ``begin_export`` can open one more streamed export now."""
        return self.board is not None and self.board.can_open()

    def begin_export(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        lease_s: float | None = None,
        readers: int = 1,
        window_from: int = 0,
    ) -> KVDescriptor:
        """Export blocks whose KV is still being computed (layer-wise streaming; check
        ``can_stream`` first). Sinks may start pulling at once and take each layer as
        ``layer_ready`` announces it. The caller owes every layer's ``layer_ready``
        in order, or a ``release``; the lease starts now."""
        if not self.can_stream():
            raise ValueError(f"backend {self.backend!r} cannot open a streamed export now")
        if readers < 1:
            raise ValueError("a streamed export needs a reader")
        self._check_window(block_ids, window_from)
        ref = self.board.open()
        return self._start(request_id, block_ids, num_tokens, lease_s, readers, (), ref, window_from)

    def layer_ready(self, transfer_id: str, layer: int, checksum: int) -> None:
        """Layer ``layer`` of a streamed export is final (call in layer order)."""
        exp = self._exports.get(transfer_id)
        if exp is None or exp.descriptor.stream is None:
            return  # ended meanwhile (released, expired): nobody reads it any more
        self.board.publish(exp.descriptor.stream, layer, checksum)

    def _start(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        lease_s: float | None,
        readers: int,
        layer_checksums: tuple[int, ...],
        stream: StreamSlot | None,
        window_from: int,
    ) -> KVDescriptor:
        if not block_ids:
            raise ValueError("nothing to export: no blocks")
        if readers < 0:
            raise ValueError("readers must be >= 0")
        transfer_id = f"{request_id}:{uuid.uuid4().hex[:12]}"
        layout = self.compat.layout
        num_bytes = layout.moved_bytes(len(block_ids), window_from) if readers else 0
        desc = KVDescriptor(
            transfer_id=transfer_id,
            request_id=request_id,
            backend=self.backend,
            source_worker=self.worker_id,
            source_incarnation=self.incarnation,
            compat_hash=self.compat.hash,
            block_ids=tuple(block_ids),
            num_tokens=num_tokens,
            num_bytes=num_bytes,
            layer_checksums=layer_checksums,
            lease_expiry=time.time() + (self.lease_s if lease_s is None else lease_s),
            stream=stream,
            window_from=window_from,
        )
        if not readers:  # nobody reads it: never published, its lease over at once
            self._ended.append(LeaseEnd(transfer_id, request_id, desc.block_ids, TransferState.CONFIRMED))
            return desc
        payload = self._publish(desc)
        if payload is not None:
            desc = dataclasses.replace(desc, payload=payload)
        self._exports[transfer_id] = _Export(desc, check_transition(None, TransferState.EXPORTED), readers)
        return desc

    def confirm(self, transfer_id: str) -> None:
        """A sink holds a verified copy; the lease ends with the last of the export's
        ``readers`` (with one reader, idempotent; a no-op once the lease ended)."""
        exp = self._exports.get(transfer_id)
        if exp is None:
            return
        exp.confirmations_left -= 1
        if exp.confirmations_left <= 0:
            self._end(transfer_id, TransferState.CONFIRMED)

    def release(self, transfer_id: str) -> None:
        """Give an export up (request cancelled): stop serving it, end its lease."""
        self._end(transfer_id, TransferState.RELEASED)

    def poll(self) -> list[LeaseEnd]:
        """Drive the backend; return every export whose lease ended since the last call.
        The caller releases those blocks in its engine."""
        for transfer_id in self._progress():
            self.confirm(transfer_id)
        now = time.time()
        for tid, exp in list(self._exports.items()):
            if exp.descriptor.lease_expiry <= now:
                log.warning("KV lease of %s expired unconfirmed; releasing its blocks", tid)
                self._end(tid, TransferState.EXPIRED)
        ended, self._ended = self._ended, []
        return ended

    @property
    def num_exported(self) -> int:
        return len(self._exports)

    def close(self) -> None:
        """Stop serving; leases that are still open are returned by no later poll."""
        self._exports.clear()

    # ---- internals ------------------------------------------------------------
    def _end(self, transfer_id: str, state: TransferState) -> None:
        exp = self._exports.pop(transfer_id, None)
        if exp is None:
            return
        exp.state = check_transition(exp.state, state)
        if exp.descriptor.stream is not None:
            self.board.close(exp.descriptor.stream)
        self._unpublish(exp.descriptor)
        d = exp.descriptor
        self._ended.append(LeaseEnd(d.transfer_id, d.request_id, d.block_ids, state))

    def _check_window(self, block_ids: list[int], window_from: int) -> None:
        if not 0 <= window_from <= len(block_ids) or (window_from and not self.compat.layout.windows):
            raise ValueError(f"window_from {window_from} for {len(block_ids)} blocks of a layout without it")
        self.compat.layout.layer_span(0, len(block_ids), window_from)  # ValueError: no transfer's ids

    def _is_live(self, transfer_id: str) -> bool:
        exp = self._exports.get(transfer_id)
        return exp is not None and exp.descriptor.lease_expiry > time.time()

    def _payload(self) -> object:
        return None

    def _publish(self, desc: KVDescriptor) -> object:
        return None

    def _unpublish(self, desc: KVDescriptor) -> None:
        pass

    def _progress(self) -> list[str]:
        return []
