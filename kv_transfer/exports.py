"""What a worker holds under a lease, and when it may give the blocks back (``lend``:
an export opened in the ledger).

One ``ExportLedger`` per prefill worker, used only on its engine thread. A request's
KV is exported by rank 0 (one transfer, ``opened``) and, in a TP group, by every
other rank (its shard of the heads, ``shards_opened``). The blocks go back to the
engine only when every one of those leases has ended: rank 0's (its source reports
a ``LeaseEnd``: confirmed, expired or released) and each other rank's (reported by
that rank, ``shards_ended``). ``take_released`` names the requests that reached
that point since it was last called; the worker releases their blocks.

A request's states here::

    opened ──► (rank 0's lease ends) ──► [shards open] ──► (each shard ends) ──► released
       │                                  └─ none ──────────────────────────────► released
       └─ a newer export of the same request replaces the transfer (a streamed export
          given up when its step failed): the old transfer's end changes nothing

    rank 0's lease ends unconfirmed (expired, released) while shards are open:
        ``ended`` returns True and the worker tells the other ranks to release theirs
        (their ends are then reported as any other)

The counts of rank 0's lease ends by state (``lease_ends``) are the worker's stats.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from splitserve.kv_transfer.source import KVSource
from splitserve.wire.kv import KVDescriptor, LeaseEnd, Leases, TransferState
from splitserve.wire.outputs import PrefilledRequest


class ExportLedger:
    """Request -> the transfers it holds under a lease; see the module docstring."""

    def __init__(self) -> None:
        self._transfers: dict[str, str] = {}  # request id -> rank 0's transfer, lease open
        self._shards: dict[str, set[int]] = {}  # request id -> ranks > 0 whose lease is open
        self._ended: dict[str, None] = {}  # requests with a lease end since take_released (ordered)
        self.lease_ends = {
            s: 0 for s in (TransferState.CONFIRMED, TransferState.EXPIRED, TransferState.RELEASED)
        }

    def opened(self, request_id: str, transfer_id: str) -> None:
        """Rank 0 exported ``request_id`` as ``transfer_id`` (a later export replaces it)."""
        self._transfers[request_id] = transfer_id

    def shards_opened(self, request_id: str, ranks: Iterable[int]) -> None:
        """The other ranks exported their shards of ``request_id``."""
        self._shards[request_id] = set(ranks)

    def transfer(self, request_id: str) -> str | None:
        """Rank 0's transfer of ``request_id`` while its lease is open (abort releases it)."""
        return self._transfers.get(request_id)

    def held(self) -> set[str]:
        """Requests with a lease still open on some rank, or blocks not yet given back."""
        return self._transfers.keys() | self._shards.keys()

    def leases(self) -> Leases:
        """``held`` and ``lease_ends``, as one record."""
        ends = self.lease_ends
        return Leases(
            tuple(sorted(self.held())),
            ends[TransferState.CONFIRMED],
            ends[TransferState.EXPIRED],
            ends[TransferState.RELEASED],
        )

    @property
    def shards_open(self) -> bool:
        """Whether any request still has shards to hear about (the worker polls the ranks)."""
        return bool(self._shards)

    def ended(self, end: LeaseEnd) -> bool:
        """Rank 0's lease of ``end.request_id`` ended; True when it ended unconfirmed while
        other ranks' shards are open (the worker then tells them to release theirs)."""
        self.lease_ends[end.state] += 1
        self._ended[end.request_id] = None
        held = self._transfers.get(end.request_id)
        if held is not None and held != end.transfer_id:
            return False  # an export given up and replaced: the newer one holds the blocks
        self._transfers.pop(end.request_id, None)
        shards = self._shards.get(end.request_id)
        if end.state != TransferState.CONFIRMED and shards:
            shards.clear()  # they are told to release: nothing more to wait for from them
            return True
        return False

    def shards_ended(self, rank: int, request_ids: Iterable[str]) -> None:
        """Rank ``rank``'s leases of ``request_ids`` ended."""
        for request_id in request_ids:
            self._shards.get(request_id, set()).discard(rank)

    def take_released(self) -> list[str]:
        """The requests whose every lease has ended since the last call: their blocks go
        back to the engine now (each named once)."""
        candidates = [*self._ended, *(r for r, ranks in self._shards.items() if not ranks)]
        self._ended = {}
        released = []
        for request_id in dict.fromkeys(candidates):
            if request_id in self._transfers or self._shards.get(request_id):
                continue
            self._shards.pop(request_id, None)
            released.append(request_id)
        return released


def lend(
    source: KVSource,
    lock: threading.Lock,
    ledger: ExportLedger,
    request_id: str,
    kv: PrefilledRequest,
    release: Callable[[], None],
) -> KVDescriptor:
    """Export the blocks ``kv`` names (held for ``request_id``) from ``source`` (under
    ``lock``) under a lease, opened in ``ledger``; if the export fails, ``release()``
    gives the blocks back to the engine and the error is raised (nothing is opened)."""
    try:
        with lock:
            desc = source.export(request_id, kv.block_ids, kv.num_kv_tokens, window_from=kv.window_from)
    except BaseException:
        release()
        raise
    ledger.opened(request_id, desc.transfer_id)
    return desc
