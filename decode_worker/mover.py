"""A decode worker's side of moving its running requests to another (live migration).

``RequestMover`` owns the worker's KV source (its whole cache registered with the
transfer backend, as a prefill worker's is), the thread that keeps it moving
(``kv_transfer.polling``) and the ledger of what it holds under a lease
(``kv_transfer.exports``). A request moves away in one engine command, between two
steps (``MoveOut``, run by ``engine.commands`` through this mover, the worker's
lender named ``"moves"``): the engine suspends it (``Engine.suspend``: it stops
decoding, its blocks held) and the source exports its blocks under a lease (``lend``;
after those the taker copied ahead, ``from_block``); the taker pulls them, then confirms, or the
worker releases them (``release``, on abort: the blocks at once) or the lease runs
out. On each engine tick the requests whose leases ended give their blocks back
(``tick``)::

    RUNNING --export--> held, exported --(confirmed | released | expired)--> freed

Before the move the taker may copy the request's full blocks while it still decodes
here (``decode_worker.precopy``): ``LendRunning`` exports them under a loan of their own
(``Engine.lend_running``: the loan shares the blocks, the request decodes on), freed
the same ways. A prefill worker computing a conversation's next turn may copy its
earlier turns from this worker's cache (``LendPrefix``), as from another prefill
worker's.

Only a worker of one process (TP=1) moves requests this way; a TP group's would
need every rank's export (its requests move by recompute).
"""

from __future__ import annotations

import contextlib
import threading

from splitserve.engine.engine import Engine
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.exports import ExportLedger, lend
from splitserve.kv_transfer.polling import SourcePoller
from splitserve.wire.errors import UnknownRequest
from splitserve.wire.kv import Confirmation, Handshake, KVHandoff, Leases
from splitserve.wire.outputs import PrefilledRequest


class RequestMover:
    def __init__(self, worker_id: str, engine: Engine, backend: str, lease_s: float):
        self.worker_id = worker_id
        self.source = get_backend(backend).source(
            f"{worker_id}/moves", engine.kv_cache.tensor, engine.kv_compat(), lease_s
        )
        self.ledger = ExportLedger()
        self._lock = threading.Lock()  # the poller thread's and the engine thread's
        # it polls only while an export is open: most of a decode worker's life there is none
        self._poller = SourcePoller(self.source, self._lock, f"{worker_id}-moves-poll", idle_when_empty=True)

    def handshake(self) -> Handshake:
        return self.source.handshake()

    def lend(self, engine: Engine, request_id: str, kv: PrefilledRequest) -> KVHandoff:  # engine thread
        """Export PREFILLED ``request_id``'s KV as ``kv`` names it under a lease; its blocks
        are released if that fails (``engine.commands.Lender``: the engine's side of the
        ``MoveOut``, ``LendRunning`` and ``LendPrefix`` commands runs before)."""
        desc = lend(self.source, self._lock, self.ledger, request_id, kv, lambda: engine.release(request_id))
        self._poller.wake()
        return KVHandoff(self.worker_id, (desc,), kv.adapter_digest)

    def leases(self) -> Leases:  # engine thread
        return self.ledger.leases()

    def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:  # any thread
        """The taker holds verified copies: their leases end (the poller reports it)."""
        with self._lock:
            for c in confirmations:
                self.source.confirm(c.transfer_id)

    def release(self, engine: Engine, request_id: str) -> bool:  # engine thread
        """Let go of ``request_id``'s export, if one is open, and of its blocks at once (a
        pull still reading them would fail its checksums, not yield tokens), so that the
        id is free here again. Whether there was one."""
        transfer = self.ledger.transfer(request_id)
        if transfer is None:
            return False
        with self._lock:
            self.source.release(transfer)
        with contextlib.suppress(UnknownRequest):  # its lease ended and the tick released it
            engine.release(request_id)
        return True

    def tick(self, engine: Engine) -> None:  # engine thread
        """The blocks of every request whose lease ended go back to the engine."""
        for end in self._poller.ended():
            self.ledger.ended(end)
        for request_id in self.ledger.take_released():
            try:
                engine.release(request_id)
            except UnknownRequest:  # already aborted
                pass

    def close(self) -> None:
        self._poller.stop()
        with self._lock:
            self.source.close()
