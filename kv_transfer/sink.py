"""``KVSink``: the decode side of a transfer. Checks peers at handshake, pulls
blocks into the ids it is given, verifies them, confirms (see
``wire.kv``). Not thread-safe: one thread at a time drives a sink."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from splitserve.engine.kv_quant import as_bytes
from splitserve.kv_transfer.integrity import check_cache, device_checksums, layer_checksum
from splitserve.wire.errors import (
    IncompatiblePeer,
    IntegrityError,
    KVTransferError,
    LeaseExpired,
    PeerLost,
    TransferTimeout,
)
from splitserve.wire.kv import (
    PROTOCOL_VERSION,
    CompatInfo,
    Confirmation,
    Handshake,
    KVDescriptor,
    LayerProgress,
    TransferState,
    TransferStats,
    check_transition,
)


class KVSink:
    """Decode side: checks peers at handshake, pulls blocks into given ids, verifies.

    Subclasses implement ``_connect`` (set up a checked peer), ``_transfer``
    (move layers ``layers`` of ``desc`` into ``dst_blocks`` before ``deadline``,
    a ``time.monotonic()`` value, raising ``KVTransferError`` subclasses; only
    ``range(0, num_layers)`` unless ``chunked``; a sliding layer's blocks from
    ``desc.window_from`` on, a grouped layout's in its group: ``KVLayout.layer_runs``),
    ``_confirm`` (tell the source through the backend; return False if the backend has no channel for it) and,
    for a backend that streams, ``_progress`` (read a streamed export's row)."""

    backend = ""
    chunked = False  # whether _transfer can move a range of layers
    MIN_CHUNK_BYTES = 32 << 20  # layers are grouped into chunks of at least this much (host memory)
    # GPU memory: one READ of 512 MiB takes ~0.45 ms on an H200, the set-up of a READ ~0.15 ms
    # (docs/gpu.md, third run): chunks of 32 MiB left the 4k-token handoff at 0.09 of a copy
    MIN_DEVICE_CHUNK_BYTES = 512 << 20
    MAX_POLL_S = 0.001  # the longest a streamed pull sleeps between reads of the source's progress

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo):
        check_cache(cache, compat)
        self.worker_id = worker_id
        self.cache = as_bytes(cache)  # an FP8 cache moves as bytes
        self.compat = compat
        self.peers: dict[str, Handshake] = {}
        self.last_stats = TransferStats()
        self._pool: ThreadPoolExecutor | None = None  # the verifier's thread, made on first use

    def connect(self, hs: Handshake) -> None:
        """Check a source's handshake and set up the link; reconnecting to a restarted
        source (new incarnation) replaces the old link. Raises ``IncompatiblePeer``, or
        ``PeerLost`` when the backend cannot link to it (a source that died meanwhile)."""
        if hs.version != PROTOCOL_VERSION:
            raise IncompatiblePeer(
                f"worker {hs.worker_id} speaks KV transfer protocol v{hs.version}, "
                f"this one v{PROTOCOL_VERSION}"
            )
        if hs.backend != self.backend:
            raise IncompatiblePeer(
                f"worker {hs.worker_id} uses backend {hs.backend!r}, this one {self.backend!r}"
            )
        if (hs.compat.revision or self.compat.revision) and hs.compat.revision != self.compat.revision:
            raise IncompatiblePeer(
                f"worker {hs.worker_id} serves revision {hs.compat.revision or '(none)'} of "
                f"{hs.compat.model}, this one revision {self.compat.revision or '(none)'} of "
                f"{self.compat.model}: KV computed by one revision's weights means nothing to the "
                "other's, so they never exchange it"
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
        try:
            self._connect(hs, replacing=old)
        except KVTransferError:
            raise
        except Exception as e:  # the backend's own error (e.g. NIXL's, for a peer that died meanwhile)
            raise PeerLost(f"connecting to worker {hs.worker_id} failed: {e.__class__.__name__}: {e}") from e
        self.peers[hs.worker_id] = hs

    def pull(self, desc: KVDescriptor, dst_blocks: list[int], timeout: float = 10.0) -> Confirmation:
        """Move ``desc``'s KV into ``dst_blocks`` and verify it, layer by layer.

        Chunks of layers move in order; chunk k is verified on a helper thread while
        chunk k+1 moves. For a streamed descriptor, a chunk moves once the source
        shows its layers ready. ``timeout`` (seconds) bounds the whole pull, waiting
        for a streamed prefill included: past it the backend gives up and raises
        ``TransferTimeout`` (no hang, whatever the source does).

        Returns the confirmation (already delivered to the source when the backend
        can). Raises a ``KVTransferError`` subclass on any failure; then the
        contents of ``dst_blocks`` are undefined and the caller frees them."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        state = check_transition(None, TransferState.PULLING)
        stats = TransferStats(desc.num_bytes)
        try:
            self._check_descriptor(desc, dst_blocks)
            with _Verifier(self, desc, dst_blocks) as verifier:
                self._move(desc, list(dst_blocks), deadline, verifier, stats)
                state = check_transition(state, TransferState.VERIFYING)
                if desc.remaining_lease() <= 0:  # the source may have reused the blocks mid-read
                    raise LeaseExpired(f"the lease on {desc.transfer_id} ran out during the transfer")
                t1 = time.monotonic()
                verifier.finish()
                stats.verify_s = time.monotonic() - t1
        except KVTransferError:
            check_transition(state, TransferState.FAILED)
            raise
        check_transition(state, TransferState.DONE)
        t = time.monotonic()
        delivered = self._confirm(desc)
        stats.confirm_s = time.monotonic() - t
        stats.total_s = time.monotonic() - t0
        self.last_stats = stats
        return Confirmation(desc.transfer_id, desc.source_worker, delivered)

    def _move(
        self,
        desc: KVDescriptor,
        dst_blocks: list[int],
        deadline: float,
        verifier: _Verifier,
        stats: TransferStats,
    ) -> None:
        """Move every layer, a chunk at a time, handing each chunk to ``verifier``
        once its checksums are known."""
        num_layers = self.compat.layout.num_layers
        chunk = self._layers_per_chunk(len(dst_blocks))
        ready = num_layers
        if desc.stream is None:
            verifier.trust(desc.layer_checksums)
        moved = 0
        while moved < num_layers:
            if desc.stream is not None:  # one row read per chunk: also trusts earlier layers' checksums
                t = time.monotonic()
                ready = self._await_layers(desc, moved, deadline, verifier)
                stats.wait_s += time.monotonic() - t
            stop = min(ready, moved + chunk)
            if self.chunked and stop == num_layers and stop - moved > 1:
                stop -= 1  # the last layer alone: only its verification follows the last byte
            t = time.monotonic()
            self._transfer(desc, dst_blocks, deadline, range(moved, stop))
            stats.transfer_s += time.monotonic() - t
            t = time.monotonic()
            verifier.moved(stop)
            stats.hash_s += time.monotonic() - t
            moved = stop
        if desc.stream is not None:  # the last layers' checksums: a read after they were shown ready
            verifier.trust(self._progress(desc, deadline).checksums)

    def _await_layers(self, desc: KVDescriptor, moved: int, deadline: float, verifier: _Verifier) -> int:
        """Read the streamed export's row until more than ``moved`` layers are ready; the
        checksums of layers an earlier read showed ready go to ``verifier``."""
        spins = 0
        while True:
            progress = self._progress(desc, deadline)
            verifier.trust(progress.checksums[: verifier.shown_ready])
            verifier.shown_ready = progress.ready
            if progress.ready > moved:
                return progress.ready
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"{desc.source_worker} did not finish layer {moved} of {desc.transfer_id} in time"
                )
            spins += 1  # spin a little, then back off to MAX_POLL_S: the decode steps need the CPU
            time.sleep(0 if spins < 20 else min(self.MAX_POLL_S, 1e-5 * 2 ** ((spins - 20) // 4)))

    def _layers_per_chunk(self, num_blocks: int) -> int:
        if not self.chunked:
            return self.compat.layout.num_layers
        layer_bytes = self.compat.layout.planes * self.compat.layout.block_bytes * num_blocks
        least = self.MIN_CHUNK_BYTES if self.cache.device.type == "cpu" else self.MIN_DEVICE_CHUNK_BYTES
        return max(1, -(-least // layer_bytes))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _verify_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kv-verify-{self.worker_id}")
        return self._pool

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
        try:
            self.compat.layout.layer_span(0, len(desc.block_ids), desc.window_from)
        except ValueError:
            raise IncompatiblePeer(
                f"descriptor {desc.transfer_id} names window_from {desc.window_from} "
                f"for {len(desc.block_ids)} blocks"
            ) from None
        if not 0 <= desc.window_from <= len(desc.block_ids):
            raise IncompatiblePeer(f"descriptor {desc.transfer_id} names window_from {desc.window_from}")
        if desc.remaining_lease() <= 0:
            raise LeaseExpired(f"the lease on {desc.transfer_id} expired before the pull started")

    def _connect(self, hs: Handshake, replacing: Handshake | None) -> None:
        pass

    def _transfer(self, desc: KVDescriptor, dst_blocks: list[int], deadline: float, layers: range) -> None:
        raise NotImplementedError

    def _progress(self, desc: KVDescriptor, deadline: float) -> LayerProgress:
        raise IncompatiblePeer(f"backend {self.backend!r} cannot follow a streamed export")

    def _confirm(self, desc: KVDescriptor) -> bool:
        return False


class _Verifier:
    """Checks a pull's layers against their checksums as soon as a layer has both moved
    and a trusted checksum: a host cache's on one helper thread, a GPU cache's by a
    kernel queued on the device (the pulling thread only launches it, then moves the
    next chunk while it runs); ``finish`` waits and raises ``IntegrityError`` for the
    first bad layer. Used only by the pulling thread."""

    def __init__(self, sink: KVSink, desc: KVDescriptor, dst_blocks: list[int]):
        self.sink, self.desc, self.dst = sink, desc, list(dst_blocks)
        self.checksums: list[int] = []  # trusted, layers [0, len)
        self.num_moved = 0
        self.shown_ready = 0  # a streamed export: layers an earlier read showed ready
        self._submitted = 0
        self._futures: list[tuple[int, Future[int]]] = []
        self._device = device_checksums(sink.cache)  # None: hashed on the host

    def __enter__(self) -> _Verifier:
        return self

    def __exit__(self, *exc) -> None:
        # On an error: the host's running hashes end before the caller frees the blocks. A
        # GPU's queued kernels need no wait: they only read the blocks, and their sums are
        # never read back, so a block reused meanwhile changes nothing anyone sees.
        for _, fut in self._futures:
            fut.cancel()
        for _, fut in self._futures:
            if not fut.cancelled():
                fut.exception()

    def trust(self, checksums: tuple[int, ...] | list[int]) -> None:
        if len(checksums) > len(self.checksums):
            self.checksums = list(checksums)
            self._submit()

    def moved(self, num_layers: int) -> None:
        self.num_moved = num_layers
        self._submit()

    def finish(self) -> None:
        if self._submitted < self.sink.compat.layout.num_layers:
            raise RuntimeError(f"verifying {self.desc.transfer_id}: layers moved or checksums missing")
        if self._device is not None:
            got_all = enumerate(self._device.values())
        else:
            got_all = ((layer, fut.result()) for layer, fut in self._futures)
        for layer, got in got_all:
            if got != self.checksums[layer]:
                raise IntegrityError(
                    f"KV of request {self.desc.request_id} arrived corrupted from "
                    f"{self.desc.source_worker}: layer {layer} has checksum {got:016x}, "
                    f"expected {self.checksums[layer]:016x}"
                )

    def _submit(self) -> None:
        lay = self.sink.compat.layout
        while self._submitted < min(self.num_moved, len(self.checksums)):
            layer = self._submitted
            blocks = lay.layer_blocks(layer, self.dst, self.desc.window_from)
            if self._device is not None:
                self._device.add(self.sink.cache[lay.row(layer)], blocks)
            else:
                pool = self.sink._verify_pool()
                self._futures.append(
                    (layer, pool.submit(layer_checksum, self.sink.cache, layer, blocks, lay))
                )
            self._submitted += 1
