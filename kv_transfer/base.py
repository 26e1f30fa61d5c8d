"""The two sides every backend implements, and the bookkeeping they share.

``KVSource`` (prefill worker) and ``KVSink`` (decode worker) each wrap one
worker's KV cache tensor (``Engine.kv_cache.tensor``), registered with the
backend once. See ``splitserve.kv_transfer.contract`` for the lifecycle and
who frees what. Not thread-safe: one thread drives a source or a sink (the
engine's loop), calling ``KVSource.poll()`` between steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass

import torch

from splitserve.kv_transfer.contract import (
    PROTOCOL_VERSION,
    CompatInfo,
    Confirmation,
    Handshake,
    KVDescriptor,
    LeaseEnd,
    TransferState,
    TransferStats,
    check_transition,
)
from splitserve.kv_transfer.errors import (
    IncompatiblePeer,
    IntegrityError,
    KVTransferError,
    LeaseExpired,
    PeerLost,
)
from splitserve.kv_transfer.integrity import checksum

log = logging.getLogger(__name__)


def _check_cache(cache: torch.Tensor, compat: CompatInfo) -> None:
    lay = compat.layout
    expected = (lay.num_layers, 2, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
    if tuple(cache.shape) != expected or str(cache.dtype) != f"torch.{lay.dtype}":
        raise ValueError(f"KV cache {tuple(cache.shape)} {cache.dtype} does not match layout {lay}")
    if not cache.is_contiguous():
        raise ValueError("the KV cache tensor must be contiguous")


@dataclass
class _Export:
    descriptor: KVDescriptor
    state: TransferState
    confirmations_left: int = 1


class KVSource:
    """Prefill side: exports blocks, holds them under leases, serves reads.

    Subclasses implement ``_publish`` (make a transfer readable; may return a
    descriptor payload), ``_unpublish`` and ``_progress`` (drive the backend and
    return the transfer ids confirmed through its channel)."""

    backend = ""

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo, lease_s: float = 30.0):
        _check_cache(cache, compat)
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex
        self.cache = cache
        self.compat = compat
        self.lease_s = lease_s
        self._exports: dict[str, _Export] = {}
        self._ended: list[LeaseEnd] = []

    # ---- control plane ------------------------------------------------------
    def handshake(self) -> Handshake:
        return Handshake(
            PROTOCOL_VERSION, self.backend, self.worker_id, self.incarnation, self.compat, self._payload()
        )

    def export(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        lease_s: float | None = None,
        readers: int = 1,
    ) -> KVDescriptor:
        """Hash the blocks, start a lease, make them readable. The caller must not
        write to or free ``block_ids`` until ``poll`` returns this transfer's ``LeaseEnd``.
        The lease is confirmed once ``readers`` sinks have each confirmed it (more than
        one when decode ranks of a larger TP group each take some of its KV heads)."""
        if not block_ids:
            raise ValueError("nothing to export: no blocks")
        if readers < 1:
            raise ValueError("readers must be >= 1")
        transfer_id = f"{request_id}:{uuid.uuid4().hex[:12]}"
        desc = KVDescriptor(
            transfer_id=transfer_id,
            request_id=request_id,
            backend=self.backend,
            source_worker=self.worker_id,
            source_incarnation=self.incarnation,
            compat_hash=self.compat.hash,
            block_ids=tuple(block_ids),
            num_tokens=num_tokens,
            num_bytes=2 * self.compat.layout.num_layers * self.compat.layout.block_bytes * len(block_ids),
            checksum=checksum(self.cache, block_ids),
            lease_expiry=time.time() + (self.lease_s if lease_s is None else lease_s),
        )
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
        self._unpublish(exp.descriptor)
        d = exp.descriptor
        self._ended.append(LeaseEnd(d.transfer_id, d.request_id, d.block_ids, state))

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


class KVSink:
    """Decode side: checks peers at handshake, pulls blocks into given ids, verifies.

    Subclasses implement ``_connect`` (set up a checked peer), ``_transfer``
    (move the bytes of ``desc`` into ``dst_blocks`` before ``deadline``, a
    ``time.monotonic()`` value, raising ``KVTransferError`` subclasses) and
    ``_confirm`` (tell the source through the backend; return False if the
    backend has no channel for it)."""

    backend = ""

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo):
        _check_cache(cache, compat)
        self.worker_id = worker_id
        self.cache = cache
        self.compat = compat
        self.peers: dict[str, Handshake] = {}
        self.last_stats = TransferStats()

    def connect(self, hs: Handshake) -> None:
        """Check a source's handshake and set up the link; reconnecting to a restarted
        source (new incarnation) replaces the old link. Raises ``IncompatiblePeer``."""
        if hs.version != PROTOCOL_VERSION:
            raise IncompatiblePeer(
                f"worker {hs.worker_id} speaks KV transfer protocol v{hs.version}, "
                f"this one v{PROTOCOL_VERSION}"
            )
        if hs.backend != self.backend:
            raise IncompatiblePeer(
                f"worker {hs.worker_id} uses backend {hs.backend!r}, this one {self.backend!r}"
            )
        if hs.compat.hash != self.compat.hash:
            mine, theirs = self.compat.fields(), hs.compat.fields()
            diff = ", ".join(
                f"{k}: {theirs[k]!r} there vs {mine[k]!r} here" for k in mine if mine[k] != theirs.get(k)
            )
            raise IncompatiblePeer(f"worker {hs.worker_id} has an incompatible KV cache ({diff})")
        old = self.peers.get(hs.worker_id)
        if old is not None and old.incarnation == hs.incarnation:
            return
        self._connect(hs, replacing=old)
        self.peers[hs.worker_id] = hs

    def pull(self, desc: KVDescriptor, dst_blocks: list[int], timeout: float = 10.0) -> Confirmation:
        """Move ``desc``'s KV into ``dst_blocks`` and verify it.

        ``timeout`` (seconds) bounds the transfer: past it the backend gives up and
        raises ``TransferTimeout`` (no hang, whatever the source does); the
        verification after it is one local hash pass over the bytes.

        Returns the confirmation (already delivered to the source when the backend
        can). Raises a ``KVTransferError`` subclass on any failure; then the
        contents of ``dst_blocks`` are undefined and the caller frees them."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        state = check_transition(None, TransferState.PULLING)
        try:
            self._check_descriptor(desc, dst_blocks)
            self._transfer(desc, list(dst_blocks), deadline)
            t1 = time.monotonic()
            state = check_transition(state, TransferState.VERIFYING)
            if desc.remaining_lease() <= 0:  # the source may have reused the blocks mid-read
                raise LeaseExpired(f"the lease on {desc.transfer_id} ran out during the transfer")
            got = checksum(self.cache, dst_blocks)
            if got != desc.checksum:
                raise IntegrityError(
                    f"KV of request {desc.request_id} arrived corrupted from {desc.source_worker} "
                    f"(checksum {got:016x}, expected {desc.checksum:016x})"
                )
            t2 = time.monotonic()
        except KVTransferError:
            check_transition(state, TransferState.FAILED)
            raise
        check_transition(state, TransferState.DONE)
        delivered = self._confirm(desc)
        self.last_stats = TransferStats(desc.num_bytes, t1 - t0, t2 - t1, time.monotonic() - t0)
        return Confirmation(desc.transfer_id, desc.source_worker, delivered)

    def close(self) -> None:
        pass

    def _check_descriptor(self, desc: KVDescriptor, dst_blocks: list[int]) -> None:
        peer = self.peers.get(desc.source_worker)
        if peer is None:
            raise PeerLost(f"no handshake with worker {desc.source_worker}; connect() first")
        if peer.incarnation != desc.source_incarnation:
            raise PeerLost(f"worker {desc.source_worker} restarted since it exported {desc.transfer_id}")
        if desc.compat_hash != self.compat.hash:
            raise IncompatiblePeer(f"descriptor {desc.transfer_id} was made for another model or layout")
        if len(dst_blocks) != len(desc.block_ids):
            raise ValueError(f"{len(desc.block_ids)} blocks to pull but {len(dst_blocks)} given")
        if desc.remaining_lease() <= 0:
            raise LeaseExpired(f"the lease on {desc.transfer_id} expired before the pull started")

    def _connect(self, hs: Handshake, replacing: Handshake | None) -> None:
        pass

    def _transfer(self, desc: KVDescriptor, dst_blocks: list[int], deadline: float) -> None:
        raise NotImplementedError

    def _confirm(self, desc: KVDescriptor) -> bool:
        return False
