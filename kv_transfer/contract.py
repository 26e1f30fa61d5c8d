"""The KV transfer contract: what crosses between a prefill and a decode worker.

Roles (as vLLM's KVConnector splits scheduler and worker): the *control plane*
(the workers and the router, through Ray calls) moves small typed records —
``Handshake`` once per peer pair, ``KVDescriptor`` once per request,
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
  has one (``Confirmation.delivered`` is then True); otherwise the caller
  forwards the ``Confirmation`` through the control plane to
  ``KVSource.confirm``. Confirming an ended lease is a no-op. An export made
  with ``readers=n`` (decode ranks of a larger TP group each taking some of
  its heads) stays leased until it has been confirmed n times, so each reader
  confirms exactly once (``pull`` does); with one reader, confirming again is
  harmless.

Integrity: the source hashes the exported blocks (xxHash3-64 over every
layer's K and V bytes of those blocks, in order) at export; the sink hashes
what landed and raises ``IntegrityError`` on a mismatch. Costs one read of the
bytes on each side (~25-30 GB/s single-threaded here; NIXL moves ~14 GB/s, so
the two passes together cost about one transfer time; see docs/kv_transfer.md).
Descriptors also carry the source's incarnation (a fresh id per process), so a
descriptor from a restarted source fails with ``PeerLost``
instead of reading the new process's memory.

Compatibility: ``Handshake`` carries ``PROTOCOL_VERSION`` and a compatibility
hash over (model, dtype, block size, layers, KV heads, head dim, TP size and
rank); a sink refuses a mismatch at handshake with ``IncompatiblePeer``, naming
the field. Workers of different TP sizes meet through ``tp_mapping``, which
pulls each source shard into a staging cache of exactly that shard's layout.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import time
from dataclasses import dataclass

from splitserve.engine.kv_cache import KVLayout

PROTOCOL_VERSION = 1


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


@dataclass(frozen=True)
class CompatInfo:
    """What two workers must agree on for one's KV bytes to mean the same to the other."""

    model: str  # model identity, e.g. a checkpoint path/name plus revision
    layout: KVLayout  # num_blocks is excluded from the hash: pools may differ in size

    def fields(self) -> dict[str, object]:
        layout = dataclasses.asdict(self.layout)
        layout.pop("num_blocks")
        return {"model": self.model, **layout}

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
    checksum: int  # xxh3-64, see module docstring
    lease_expiry: float  # time.time() after which the source may reuse the blocks
    payload: object = None  # backend-specific (e.g. a Ray ObjectRef)

    def remaining_lease(self, now: float | None = None) -> float:
        return self.lease_expiry - (time.time() if now is None else now)


@dataclass(frozen=True)
class KVShard:
    """The KV of one request held by TP rank r > 0 of a prefill group (rank 0's travels
    as the plain descriptor and handshake): a sink merges every rank's heads."""

    handshake: Handshake
    descriptor: KVDescriptor


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


@dataclass
class TransferStats:
    """Timings of one pull (seconds), for benchmarks and logs."""

    num_bytes: int = 0
    transfer_s: float = 0.0  # moving bytes only
    verify_s: float = 0.0
    total_s: float = 0.0
