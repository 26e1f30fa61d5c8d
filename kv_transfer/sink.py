"""``KVSink``: the decode side of a transfer. Checks peers at handshake, pulls
blocks into the ids it is given, verifies them, confirms (see
``kv_transfer.contract``). Not thread-safe: one thread at a time drives a sink."""

from __future__ import annotations

import time

import torch

from splitserve.kv_transfer.contract import (
    PROTOCOL_VERSION,
    CompatInfo,
    Confirmation,
    Handshake,
    KVDescriptor,
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
from splitserve.kv_transfer.integrity import check_cache, checksum


class KVSink:
    """Decode side: checks peers at handshake, pulls blocks into given ids, verifies.

    Subclasses implement ``_connect`` (set up a checked peer), ``_transfer``
    (move the bytes of ``desc`` into ``dst_blocks`` before ``deadline``, a
    ``time.monotonic()`` value, raising ``KVTransferError`` subclasses) and
    ``_confirm`` (tell the source through the backend; return False if the
    backend has no channel for it)."""

    backend = ""

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo):
        check_cache(cache, compat)
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
