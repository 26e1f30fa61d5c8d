"""Errors of the KV transfer layer: all are ``KVTransferError`` (a ``SplitserveError``).

Each one means the same thing to the caller: this transfer produced no usable
KV; free the blocks allocated for it and retry elsewhere or fail the request.
The subclass says why, for logs and metrics.
"""

from __future__ import annotations

from splitserve.engine.errors import SplitserveError


class KVTransferError(SplitserveError):
    """A KV transfer failed; the destination blocks hold nothing usable."""


class IncompatiblePeer(KVTransferError):
    """The two sides disagree on protocol version, backend, model, dtype, block size, layout or TP."""


class TransferTimeout(KVTransferError):
    """The transfer did not finish within its deadline (the peer may be stalled or gone)."""


class PeerLost(KVTransferError):
    """The source worker is gone or restarted: its blocks can no longer be read."""


class IntegrityError(KVTransferError):
    """The bytes received do not match the checksum the source computed at export."""


class LeaseExpired(KVTransferError):
    """The source's lease on the blocks ran out, so it may have reused them."""


class HandshakeRequired(KVTransferError):
    """The sink holds no handshake for the source incarnation a handoff names (a new
    peer, or either side restarted): send the source's handshakes, then retry."""
