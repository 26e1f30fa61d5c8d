"""The KV transfer contract: what crosses between a prefill and a decode worker.

Roles (as vLLM's KVConnector splits scheduler and worker): the *control plane*
(the two workers, calling each other through Ray; the router only names the
source in the decode worker's task) moves small typed records —
``Handshake`` once per peer pair (cached by the source's incarnation),
``KVHandoff`` (the descriptors of one request) once per request,
``Confirmation`` back — and decides what moves where. The *data plane* is a
backend's ``KVSource`` (prefill side) and ``KVSink`` (decode side), which own
the registered KV memory and move the bytes.

Lifecycle of one request's KV (``TransferState``)::

    prefill side (KVSource)                     decode side (KVSink)
    ------------------------                    --------------------
    engine PREFILLED
      export() ──► EXPORTED ── KVDescriptor ──► caller allocates blocks
                  (blocks held                  pull() ──► PULLING
                   under a lease)                            │ bytes land in the
                     │                                       ▼ caller's blocks
                     │                                    VERIFYING (checksum)
                     │                                    │            │
                     │ ◄──────── Confirmation ─────────  DONE        FAILED
                     ▼                                  (activate)   (raises KVTransferError;
                 CONFIRMED: poll() returns it,                       caller frees its blocks)
                   caller releases the blocks
                 EXPIRED: lease ran out first;
                   poll() returns it, caller
                   releases the blocks

Who frees what, when:

- The source never frees engine blocks itself. ``KVSource.poll()`` returns a
  ``LeaseEnd`` for every export that was confirmed, expired or released, and
  the caller (the prefill worker) calls ``Engine.release`` for it. The source
  stops serving reads of a transfer the moment its lease ends.
- The sink writes only into the block ids the caller gives ``pull``; if
  ``pull`` raises, the caller frees them (``Engine.abort``). A failed pull never
  yields tokens.
- Confirmation: ``pull`` confirms through the backend's own channel when it
  has one (``Confirmation.delivered`` is then True: nixl, torch_dist, ucx,
  local); otherwise (ray, or a ucx message that failed) the caller delivers
  the ``Confirmation`` through the control plane to ``KVSource.confirm``. In
  the cluster the decode worker does
  so itself, right after the pull: it calls the prefill worker's ``confirm``
  through the handle its task carries (``DecodeTask.source``), without waiting
  for the answer, so the prefill blocks are freed at the pull for every
  backend, not at the end of the request.
  Confirming an ended lease is a no-op. An export made
  with ``readers=n`` (decode ranks of a larger TP group each taking some of
  its heads) stays leased until it has been confirmed n times, so each reader
  confirms exactly once (``pull`` does); with one reader, confirming again is
  harmless.

Integrity: one xxHash3-64 per layer over that layer's K then V bytes of the
exported blocks (``integrity.layer_checksum``). A prefill worker hashes each
layer as the forward pass writes it (``layerwise.LayerExporter``), so export
itself hashes nothing; ``export`` hashes only when given no checksums. The sink
moves the KV in chunks of layers and verifies chunk k on a helper thread while
chunk k+1 moves (the hash releases the GIL), so only the last chunk's
verification adds to the handover; a mismatch raises ``IntegrityError`` naming
the layer. Descriptors also carry the source's incarnation (a fresh id per
process), so a descriptor from a restarted source fails with ``PeerLost``
instead of reading the new process's memory.

Layer-wise streaming (backends with ``KVSource.streams``: nixl, local):
``begin_export`` publishes a descriptor *before* prefill computes the KV, with
no checksums and a ``StreamSlot``: a row of the source's progress board
(``progress.ProgressBoard``). As each layer is written the source calls
``layer_ready`` (checksum first, then the count of ready layers). A sink given
a streamed descriptor reads the row (in process, or by a one-sided read of the
registered board), moves the layers that are ready while later ones compute,
and verifies each with a checksum read after it was shown ready. The lease
clock of a streamed export starts at ``begin_export``: give it room for the
prefill. An export that ends before it completes (request cancelled, prefill
failed, lease expired) changes its row's serial, and the sink fails with
``LeaseExpired``; a source that dies fails the read (``PeerLost``) or the
deadline (``TransferTimeout``). Never a hang, never unverified tokens.

Compatibility: ``Handshake`` carries ``PROTOCOL_VERSION`` and a compatibility
hash over (the weights' revision, dtype, block size, layers, KV heads, head
dim, TP size and rank: not the model's path, which may differ by node); a
sink refuses a mismatch at handshake with ``IncompatiblePeer``, naming the
field (both revisions, for a revision). Handshakes cross once per (source incarnation, sink) pair: a decode
worker keeps the handshakes it holds by the source's worker id and
incarnations, and before it pulls a ``KVHandoff`` from incarnations it holds
none for, it fetches them from the source itself (``PrefillPeer.info``) and
connects its sink (and its other TP ranks') to them; a source that restarted
since it exported (its incarnations no longer those of the handoff) or is gone
fails the handoff with ``PeerLost``.

Sliding windows (``KVLayout.windows``): a request that goes on decoding elsewhere
never reads its sliding layers' keys that fell out of the window, so its export
names ``window_from`` and those layers move (and are hashed) only from that block
on; the receiving engine never offers the blocks before it as a cached prefix
(their sliding layers hold nothing). A prefix lent to another worker's cache moves
whole (``window_from`` 0).

Workers of different TP sizes meet through ``tp_mapping``, which pulls each
source shard into a staging cache of exactly that shard's layout.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import time
from dataclasses import dataclass

from splitserve.wire.kv_layout import KVLayout

PROTOCOL_VERSION = 1
DEFAULT_LEASE_S = 30.0  # how long exported KV waits for a decode worker, unless configured


class TransferState(enum.Enum):
    EXPORTED = "exported"  # source: descriptor published, blocks held under a lease
    CONFIRMED = "confirmed"  # source: the sink confirmed; the caller releases the blocks
    EXPIRED = "expired"  # source: the lease ran out before a confirmation
    RELEASED = "released"  # source: the caller gave the transfer up (e.g. request cancelled)
    PULLING = "pulling"  # sink: bytes moving into the caller's blocks
    VERIFYING = "verifying"  # sink: checking the checksum
    DONE = "done"  # sink: verified; the request can decode
    FAILED = "failed"  # sink: raised KVTransferError; the caller frees its blocks


_TRANSITIONS: dict[TransferState | None, frozenset[TransferState]] = {
    None: frozenset({TransferState.EXPORTED, TransferState.PULLING}),
    TransferState.EXPORTED: frozenset(
        {TransferState.CONFIRMED, TransferState.EXPIRED, TransferState.RELEASED}
    ),
    TransferState.PULLING: frozenset({TransferState.VERIFYING, TransferState.FAILED}),
    TransferState.VERIFYING: frozenset({TransferState.DONE, TransferState.FAILED}),
}


def check_transition(old: TransferState | None, new: TransferState) -> TransferState:
    """Return ``new`` if ``old -> new`` is a legal step, else raise ``RuntimeError`` (a bug)."""
    if new not in _TRANSITIONS.get(old, frozenset()):
        raise RuntimeError(f"illegal KV transfer transition {old} -> {new}")
    return new


def checksum_kind(device_type: str) -> str:
    """How a transfer's bytes are checksummed in a cache on a device of ``device_type``
    (torch's: "cpu", "cuda"): xxh3-64 in host memory, ``kv_transfer.device_hash``'s kv64
    on a GPU, where the bytes are (``kv_transfer.integrity.layer_checksum``)."""
    return "kv64" if device_type == "cuda" else "xxh3-64"


@dataclass(frozen=True)
class CompatInfo:
    """What two workers must agree on for one's KV bytes to mean the same to the other."""

    model: str  # the model as configured (a name or a checkpoint path: it may differ by node)
    layout: KVLayout  # num_blocks is excluded from the hash: pools may differ in size
    # An FP8 cache's scales (layout.kv_scales names the scheme), flattened
    # [num_layers, 2 (K, V), num_kv_heads]: not part of the hash (each worker calibrates its
    # own); a sink rescales what it pulls from the source's into its own
    kv_scales: tuple[float, ...] = ()
    # which weights (engine.model.revision: a fingerprint of the checkpoint's files, and
    # the quantization applied at load); "" for a bare pool of bytes (tests, benchmarks)
    revision: str = ""
    # how the bytes are checksummed (``checksum_kind``): a cache on a GPU and one in host
    # memory do not pair
    checksum: str = "xxh3-64"

    def fields(self) -> dict[str, object]:
        """What the hash covers: the weights (their revision; a bare pool's model name,
        which has none) and the layout but its size."""
        layout = dataclasses.asdict(self.layout)
        layout.pop("num_blocks")
        return {"weights": self.revision or self.model, "checksum": self.checksum, **layout}

    @property
    def hash(self) -> str:
        blob = json.dumps(self.fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class Handshake:
    """What a source publishes once; every sink checks it in ``KVSink.connect``."""

    version: int
    backend: str
    worker_id: str
    incarnation: str  # fresh per source process: tells a restarted worker apart
    compat: CompatInfo
    payload: object = None  # backend-specific frozen dataclass (NIXL agent metadata, a store address)


@dataclass(frozen=True)
class StreamSlot:
    """Where a streamed export's progress is published: row ``slot`` of the source's
    progress board, which belongs to this export while the row's serial is ``serial``."""

    slot: int
    serial: int


@dataclass(frozen=True)
class LayerProgress:
    """One read of a streamed export's row: layers ``[0, ready)`` are final at the source.

    ``checksums[i]`` is layer i's checksum as the row held it at this read. A reader
    may trust it only for layers another, *earlier* completed read already showed
    ready (the source writes a checksum before the count, but a one-sided read may
    see the row's words in any order)."""

    ready: int
    checksums: tuple[int, ...]


@dataclass(frozen=True)
class KVDescriptor:
    """One request's exported KV: everything a sink needs to pull and verify it."""

    transfer_id: str
    request_id: str
    backend: str
    source_worker: str
    source_incarnation: str
    compat_hash: str
    block_ids: tuple[int, ...]  # source blocks, in sequence order
    num_tokens: int  # tokens of KV held in those blocks (the last block may be partial)
    num_bytes: int
    # xxh3-64 per layer (see module docstring); empty for a streamed export, whose
    # checksums are published layer by layer on the source's progress board
    layer_checksums: tuple[int, ...]
    lease_expiry: float  # time.time() after which the source may reuse the blocks
    payload: object = None  # backend-specific (e.g. a Ray ObjectRef)
    stream: StreamSlot | None = None  # set when the export streams (layers still being computed)
    # a model with sliding windows: its sliding layers' KV moves (and is hashed) only
    # from block_ids[window_from:] on (KVLayout.window_from: the blocks before hold keys
    # out of every window of what the request computes next); the full layers' whole
    window_from: int = 0

    def remaining_lease(self, now: float | None = None) -> float:
        return self.lease_expiry - (time.time() if now is None else now)


@dataclass(frozen=True)
class KVHandoff:
    """One request's exported KV, as it travels unchanged from the prefill worker's
    result to the decode worker's task: the one record of the handover.

    ``descriptors`` has one descriptor per rank of the source's TP group, in rank
    order (just one for TP=1); rank r's carries that rank's KV heads of the same
    blocks. ``incarnations`` names the exact source processes: a decode worker
    pulls only from sources whose handshakes it holds for exactly those
    incarnations, fetching them first otherwise, so handshakes cross once per
    peer pair (and again after a restart), never per request."""

    source_worker: str  # the prefill worker (rank 0's id)
    descriptors: tuple[KVDescriptor, ...]
    # the LoRA adapter the KV was computed under: its digest ("" for the base model;
    # ``Engine.adapter_digest``); the taker's engine refuses KV of another (``Engine.activate``)
    adapter_digest: str = ""

    def __post_init__(self) -> None:
        if not self.descriptors:
            raise ValueError("a handoff needs at least one descriptor")
        if len({d.request_id for d in self.descriptors}) != 1:
            raise ValueError("every descriptor of a handoff must belong to one request")

    @property
    def request_id(self) -> str:
        return self.descriptors[0].request_id

    @property
    def incarnations(self) -> tuple[str, ...]:
        """The source process of each rank: the key a decode worker's handshakes are cached by."""
        return tuple(d.source_incarnation for d in self.descriptors)

    @property
    def num_bytes(self) -> int:
        return sum(d.num_bytes for d in self.descriptors)

    def remaining_lease(self, now: float | None = None) -> float:
        """Seconds until the first of the ranks' leases ends."""
        return min(d.remaining_lease(now) for d in self.descriptors)


@dataclass(frozen=True)
class Confirmation:
    """A sink's acknowledgement that it holds a verified copy of a transfer."""

    transfer_id: str
    source_worker: str
    delivered: bool  # True if the backend already told the source


@dataclass(frozen=True)
class LeaseEnd:
    """A source-side export that ended: the caller now releases its engine blocks."""

    transfer_id: str
    request_id: str
    block_ids: tuple[int, ...]
    state: TransferState  # CONFIRMED, EXPIRED or RELEASED


@dataclass(frozen=True)
class Leases:
    """What a worker lends under leases now (request ids, every rank's lease open or
    its blocks not yet given back), and its lease ends by state since it started."""

    held: tuple[str, ...]
    confirmed: int
    expired: int
    released: int


@dataclass
class TransferStats:
    """Timings of one pull (seconds), for benchmarks and logs."""

    num_bytes: int = 0
    transfer_s: float = 0.0  # moving bytes only (summed over the chunks)
    verify_s: float = 0.0  # waiting for verification after the last chunk moved (the rest overlaps)
    wait_s: float = 0.0  # a streamed export: waiting for the source to finish layers
    hash_s: float = 0.0  # starting the verification of moved layers (a GPU's kernels queued)
    confirm_s: float = 0.0  # telling the source (a NIXL notification)
    total_s: float = 0.0


@dataclass(frozen=True)
class MeaningCheck:
    """What checking an imported request's KV by meaning found (``engine.meaning``): at
    ``position`` (the prompt's last), ``ok`` (``error``: the largest relative L2 error of
    a layer's K/V, within ``tolerance``); or the check that failed, ``kv`` (the first
    ``layer`` whose K/V differ, by ``error`` above ``tolerance``) or ``token`` (``detail``
    says which); or why the check was ``skipped``."""

    ok: bool
    position: int
    check: str = ""
    layer: int = -1
    error: float = 0.0
    tolerance: float = 0.0
    detail: str = ""
    skipped: str = ""

    def describe(self) -> str:
        """One sentence for a log or an error."""
        if self.skipped:
            return f"not checked: {self.skipped}"
        if self.ok:
            return f"its K/V at position {self.position} agree with the source's (within {self.error:.2g})"
        if self.check == "kv":
            return (
                f"layer {self.layer}'s K/V at position {self.position} differ from the source's by "
                f"{self.error:.3g} (relative; rounding stays within {self.tolerance:g})"
            )
        return f"{self.detail} (position {self.position})"
