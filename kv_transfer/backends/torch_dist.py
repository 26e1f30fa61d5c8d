"""``torch_dist``: torch.distributed point-to-point over a gloo group per peer pair.

The source hosts a ``TCPStore``; its address is the handshake payload. Each
sink that connects takes a pair number from the store and both sides build a
two-rank ``ProcessGroupGloo`` under that prefix (source rank 0, sink rank 1).
The source builds its side in ``poll()``, which must run regularly.

Per pull, on one pair (tags keep the two directions apart)::

    sink -> source  [PULL, seq]                 tag 0
    source -> sink  [OK|GONE, nbytes]           tag 1
    source -> sink  packed blocks [L, 2, n, ...] tag 1   (only if OK)
    sink -> source  [CONFIRM, seq]              tag 0    (after verifying)

The blocks are packed into one contiguous tensor on the source and scattered
into place on the sink (one extra copy each side). Gloo moves host memory; a
GPU cache is staged through the host (NCCL is a follow-up).
"""

from __future__ import annotations

import datetime
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from splitserve.kv_transfer.backends.two_sided import TransferNumbers, accepts_connections
from splitserve.kv_transfer.integrity import pack, unpack
from splitserve.kv_transfer.sink import KVSink
from splitserve.kv_transfer.source import KVSource
from splitserve.wire.errors import KVTransferError, LeaseExpired, PeerLost, TransferTimeout
from splitserve.wire.kv import CompatInfo, Handshake, KVDescriptor

log = logging.getLogger(__name__)

PULL, CONFIRM = 1, 2
OK, GONE = 1, 0
_REQ_TAG, _DATA_TAG = 0, 1
_IDLE = datetime.timedelta(days=365)
_PROBE_S = 1.0  # while a send or recv waits, how often the sink checks that the source lives


@dataclass(frozen=True)
class TorchDistPeerInfo:
    host: str
    port: int


@dataclass(frozen=True)
class TorchDistTicket:
    seq: int  # the source's number for this transfer, carried in PULL/CONFIRM messages


def _secs(s: float) -> datetime.timedelta:
    """``s`` seconds as a timedelta rounded *up* to whole milliseconds, at least one:
    gloo truncates to milliseconds, and a wait must not end before its deadline."""
    return datetime.timedelta(milliseconds=max(math.ceil(s * 1000), 1))


def _timed_out(e: RuntimeError) -> bool:
    """Whether gloo's error says a wait ran out of time ("Timed out waiting 999ms ..."),
    or that the pair was closed by an earlier timeout."""
    msg = str(e)
    return "Timed out" in msg or "imeout" in msg


class _Pair:
    """The source's end of one sink's group. A daemon thread blocks on the request
    channel (gloo's ``is_completed`` only turns true inside ``wait``) and queues
    requests; ``poll()`` serves them on the caller's thread."""

    def __init__(self, pg: dist.ProcessGroup, index: int):
        self.pg = pg
        self.requests: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self.alive = True
        threading.Thread(target=self._listen, name=f"kv-torch-dist-pair{index}", daemon=True).start()

    def _listen(self) -> None:
        buf = torch.zeros(2, dtype=torch.int64)
        try:
            while True:
                self.pg.recv([buf], 1, _REQ_TAG).wait()
                self.requests.put((int(buf[0]), int(buf[1])))
        except RuntimeError as e:  # the sink closed or died
            log.info("torch_dist sink went away: %s", e)
            self.requests.put(None)


class TorchDistSource(KVSource):
    backend = "torch_dist"

    def __init__(
        self,
        worker_id: str,
        cache: torch.Tensor,
        compat: CompatInfo,
        lease_s: float,
        *,
        host: str = "127.0.0.1",
        connect_timeout_s: float = 30.0,
    ):
        super().__init__(worker_id, cache, compat, lease_s)
        self.host = host
        self.connect_timeout_s = connect_timeout_s
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=_secs(connect_timeout_s)
        )
        self._pairs: list[_Pair] = []
        self._numbers = TransferNumbers()

    def _payload(self) -> TorchDistPeerInfo:
        return TorchDistPeerInfo(self.host, self.store.port)

    def _publish(self, desc: KVDescriptor) -> TorchDistTicket:
        return TorchDistTicket(self._numbers.add(desc.transfer_id))

    def _unpublish(self, desc: KVDescriptor) -> None:
        self._numbers.remove(desc.payload.seq)

    def _progress(self) -> list[str]:
        for k in range(len(self._pairs), self.store.add("sinks", 0)):
            store = dist.PrefixStore(f"pair{k}/", self.store)
            # the pair waits for requests for as long as both sides live
            self._pairs.append(_Pair(dist.ProcessGroupGloo(store, 0, 2, _IDLE), k))
        confirmed: list[str] = []
        for pair in self._pairs:
            while pair.alive and not pair.requests.empty():
                req = pair.requests.get()
                if req is None:
                    pair.alive = False
                    break
                kind, seq = req
                tid = self._numbers.get(seq)
                if kind == CONFIRM and tid is not None:
                    confirmed.append(tid)
                elif kind == PULL:
                    try:
                        self._serve(pair, tid)
                    except RuntimeError as e:
                        log.warning("torch_dist: serving %s failed: %s", tid, e)
                        pair.alive = False
        return confirmed

    def _serve(self, pair: _Pair, transfer_id: str | None) -> None:
        if transfer_id is None or not self._is_live(transfer_id):
            pair.pg.send([torch.tensor([GONE, 0])], 1, _DATA_TAG).wait()
            return
        desc = self._exports[transfer_id].descriptor
        layers = range(self.compat.layout.num_layers)
        data = pack(self.cache, self.compat.layout, desc.block_ids, desc.window_from, layers)
        pair.pg.send([torch.tensor([OK, desc.num_bytes])], 1, _DATA_TAG).wait()
        pair.pg.send([data], 1, _DATA_TAG).wait()


class TorchDistSink(KVSink):
    backend = "torch_dist"

    def __init__(
        self, worker_id: str, cache: torch.Tensor, compat: CompatInfo, *, connect_timeout_s: float = 30.0
    ):
        super().__init__(worker_id, cache, compat)
        self.connect_timeout_s = connect_timeout_s
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._stores: dict[str, TorchDistPeerInfo] = {}  # where each source's TCPStore listens

    def _connect(self, hs: Handshake, replacing: Handshake | None) -> None:
        info = hs.payload
        if not isinstance(info, TorchDistPeerInfo):
            raise PeerLost(f"worker {hs.worker_id} sent no torch_dist address")
        try:
            store = dist.TCPStore(
                info.host, info.port, is_master=False, timeout=_secs(self.connect_timeout_s)
            )
            k = store.add("sinks", 1) - 1
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(f"pair{k}/", store), 1, 2, _secs(self.connect_timeout_s)
            )
        except RuntimeError as e:
            raise PeerLost(f"cannot connect to {hs.worker_id} at {info.host}:{info.port}: {e}") from e
        self._groups[hs.worker_id] = pg
        self._stores[hs.worker_id] = info

    def _listening(self, worker_id: str) -> bool:
        """False once nothing accepts connections at the source's store address: its
        process is gone (a fresh connection, so a stale socket cannot hide that)."""
        info = self._stores[worker_id]
        return accepts_connections(info.host, info.port, _PROBE_S)

    def _wait(self, start, desc: KVDescriptor, deadline: float) -> None:
        """Run ``start()`` (a send or recv) and wait for it until ``deadline``.

        Gloo fails a pending operation when the peer's socket closes, but a dead source's
        socket stays open while any child process of it holds it (gloo's sockets are
        inheritable), and then the wait would last until ``deadline``. So the wait runs on
        a thread of its own while this one checks every ``_PROBE_S`` that the source's
        store (close-on-exec, so no child keeps it) still listens, and raises ``PeerLost``
        when it does not. The abandoned wait ends at ``deadline``: gloo cannot abort it
        (``abort()`` does not wake it), and a timed-out gloo wait closes the pair."""
        done: Future[None] = Future()

        def wait() -> None:
            try:
                start().wait(_secs(deadline - time.monotonic()))
                done.set_result(None)
            except BaseException as e:
                done.set_exception(e)

        threading.Thread(target=wait, name="kv-torch-dist-wait", daemon=True).start()
        try:
            while True:
                try:
                    return done.result(timeout=_PROBE_S)
                except TimeoutError:  # concurrent.futures raises the builtin one
                    if not self._listening(desc.source_worker):
                        raise PeerLost(
                            f"KV transfer {desc.transfer_id}: {desc.source_worker} is gone"
                        ) from None
        except RuntimeError as e:
            if time.monotonic() >= deadline or _timed_out(e):
                raise TransferTimeout(
                    f"KV transfer {desc.transfer_id} from {desc.source_worker} timed out"
                ) from e
            raise PeerLost(f"KV transfer {desc.transfer_id} from {desc.source_worker} failed: {e}") from e

    def _transfer(self, desc: KVDescriptor, dst_blocks: list[int], deadline: float, layers: range) -> None:
        pg = self._groups[desc.source_worker]
        self._wait(lambda: pg.send([torch.tensor([PULL, desc.payload.seq])], 0, _REQ_TAG), desc, deadline)
        header = torch.zeros(2, dtype=torch.int64)
        self._wait(lambda: pg.recv([header], 0, _DATA_TAG), desc, deadline)
        if int(header[0]) != OK:
            raise LeaseExpired(f"{desc.source_worker} no longer holds {desc.transfer_id}")
        c, lay = self.cache, self.compat.layout
        expected = lay.moved_bytes(len(dst_blocks), desc.window_from)
        if expected != int(header[1]):
            raise KVTransferError(
                f"{desc.source_worker} announced {int(header[1])} bytes, expected {expected}"
            )
        data = torch.empty(expected // c.element_size(), dtype=c.dtype)
        self._wait(lambda: pg.recv([data], 0, _DATA_TAG), desc, deadline)
        unpack(c, lay, dst_blocks, desc.window_from, range(lay.num_layers), data)

    def _confirm(self, desc: KVDescriptor) -> bool:
        try:
            self._groups[desc.source_worker].send(
                [torch.tensor([CONFIRM, desc.payload.seq])], 0, _REQ_TAG
            ).wait()
            return True
        except RuntimeError:
            log.warning("could not confirm %s over torch_dist", desc.transfer_id, exc_info=True)
            return False
