"""``ucx``: UCX through ``ucxx`` (the successor of ucx-py), two-sided over one
endpoint per peer pair.

The source listens (a ``UCXListener`` on a UCX worker of its own); the
handshake carries the listener's address. A sink opens one endpoint per source
incarnation. Requests go over UCX's stream API, which is ordered and scoped to
the endpoint, so the source knows which sink asks. Answers go back as tagged
messages, because only the tag API has UCX's rendezvous (zero-copy) protocols;
the stream API copies every fragment. Tag matching is worker-wide, so the sink
names the tag of each answer in its request (a random 62-bit base per sink,
counting up). Per pull, on the pair's endpoint::

    sink -> source  [PULL, seq, lo, hi, tag]     stream, 5 x int64
    source -> sink  [OK | GONE, nbytes, ...]     tag ``tag``
    source -> sink  layers lo..hi of the export's blocks, packed [hi - lo, 2, n, ...]
                    tag ``tag + 1``, only after OK (the sink posts its receive then)
    sink -> source  [CONFIRM, seq, 0, 0, 0]      stream, after the whole pull verified

``connect`` sends ``[PING, 0, 0, 0, tag]`` and waits for ``[OK, ...]`` on
``tag``, so an unreachable source fails at handshake (``PeerLost``), not at the
first pull.

The sink is ``chunked``: one request per chunk of layers, and the base class
verifies chunk k while chunk k+1 moves. The source packs a chunk into one
contiguous tensor (``index_select``) and the sink scatters it into its blocks
(``index_copy_``): one copy each side, as ``torch_dist``. Host memory only; a
GPU cache is staged through the host.

Progress: no progress thread (as ``nixl``: on 2 cores a thread that wakes per
message costs more than it saves). The source progresses its worker in
``poll()``, which the prefill worker calls every millisecond: accepting
endpoints, completing receives, serving requests. The sink progresses its own
worker while it waits. Each endpoint of the source keeps one request receive
posted; a completed one is answered and the next is posted.

Failure: endpoints are created with error handling, so a peer that closes or
dies fails that endpoint's requests. A sink waits at most until the pull's
deadline (``TransferTimeout``) and fails with ``PeerLost`` when its endpoint
fails or the source's probe port stops accepting connections (checked every
``PROBE_S`` while a wait lasts: a source killed while a child process holds
the UCX sockets it inherited leaves the endpoint open, but the probe port is a
Python socket, which children do not inherit). A pair whose exchange failed
midway is closed (its stream is out of step) and the sink's posted receives
are cancelled; the next pull reconnects.

Transports and speed: UCX chooses the transports. With peer error handling on
(endpoints fail when their peer does), the UCX that ucxx ships selects tcp even
between two processes of one host, since its shared-memory and cma transports
do not support peer-failure handling: 0.6-0.9 GB/s on a 2-core VM, about gloo's
speed (``docs/kv_transfer.md``). The transport is not what limits it, though: a
variant on worker-address endpoints without error handling got sysv + cma with
zero-copy rendezvous reads and moved no faster, because packing a chunk on the
source and landing it in fresh staging pages on the sink cost more than the
wire. A fast path sends from and receives into the caches' own block runs.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve.kv_transfer.backends.two_sided import TransferNumbers, accepts_connections
from splitserve.kv_transfer.integrity import pack, unpack
from splitserve.kv_transfer.sink import KVSink
from splitserve.kv_transfer.source import KVSource
from splitserve.wire.errors import KVTransferError, LeaseExpired, PeerLost, TransferTimeout
from splitserve.wire.kv import CompatInfo, Handshake, KVDescriptor
from splitserve.wire.net import default_route_ip


def _import_ucxx():
    """ucxx's core API. Importing ucxx sets ``UCX_*`` variables in ``os.environ``
    (CUDA-oriented defaults such as ``UCX_RNDV_FRAG_MEM_TYPE=cuda``), which every
    UCX context made later in the process would read, NIXL's included (with them, a
    NIXL read from a killed peer was seen to hang). The environment is put back as
    it was: this backend moves host memory and needs none of them."""
    before = dict(os.environ)
    try:
        import ucxx._lib.libucxx as api
        from ucxx._lib.arr import Array
    except ImportError as e:  # depends on the machine
        raise ImportError("the ucx backend needs ucxx: pip install ucxx-cu12 (or ucxx-cu13)") from e
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})
    return api, Array


ucx_api, Array = _import_ucxx()

log = logging.getLogger(__name__)

PING, PULL, CONFIRM = 1, 2, 3
OK, GONE = 1, 0
PROBE_S = 1.0  # while a wait lasts, how often the sink checks the source's probe port
_SPINS = 200  # progress calls before a wait starts sleeping between them


@dataclass(frozen=True)
class UcxPeerInfo:
    host: str
    port: int  # the UCX listener's
    probe_port: int  # a plain TCP port that accepts connections while the source process lives


@dataclass(frozen=True)
class UcxTicket:
    seq: int  # the source's number for this transfer, carried in PULL and CONFIRM


def _worker() -> ucx_api.UCXWorker:
    # Polled (no progress thread, no blocking mode), so no WAKEUP feature either.
    ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.STREAM, ucx_api.Feature.TAG))
    return ucx_api.UCXWorker(ctx)


def _message(*values: int) -> np.ndarray:
    out = np.zeros(5, dtype=np.int64)
    out[: len(values)] = values
    return out


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a numpy view (numpy has no bfloat16)."""
    return t.view(-1).view(torch.uint8).numpy()


class _Failed(Exception):
    """A request of a pair failed: the pair is closed."""


@dataclass
class _Pair:
    """The source's end of one sink's endpoint: the request receive it keeps posted,
    and the sends of its answers until they complete (their buffers stay alive)."""

    ep: ucx_api.UCXEndpoint
    inbox: np.ndarray = field(default_factory=lambda: _message())
    receiving: ucx_api.UCXRequest | None = None
    sending: list[tuple[ucx_api.UCXRequest, object]] = field(default_factory=list)

    def listen(self) -> None:
        self.receiving = self.ep.stream_recv(Array(self.inbox))

    def send(self, buf: np.ndarray, tag: int) -> None:
        self.sending.append((self.ep.tag_send(Array(buf), ucx_api.UCXXTag(tag)), buf))

    def reap(self) -> None:
        """Drop completed sends; ``_Failed`` if any failed."""
        pending = []
        for req, buf in self.sending:
            if req.completed:
                _check(req)
            else:
                pending.append((req, buf))
        self.sending = pending

    def take(self) -> tuple[int, int, int, int, int] | None:
        """The request received (kind, seq, lo, hi, tag), if one completed; the next
        receive is posted."""
        req = self.receiving
        if req is None or not req.completed:
            return None
        _check(req)
        kind, seq, lo, hi, tag = (int(x) for x in self.inbox)
        self.listen()
        return kind, seq, lo, hi, tag


def _check(req: ucx_api.UCXRequest) -> None:
    try:
        req.check_error()
    except Exception as e:  # ucxx raises its own UCXError subclasses
        raise _Failed(f"{e.__class__.__name__}: {e}") from e


class UcxSource(KVSource):
    backend = "ucx"

    def __init__(
        self,
        worker_id: str,
        cache: torch.Tensor,
        compat: CompatInfo,
        lease_s: float,
        *,
        host: str | None = None,
    ):
        """``host``: the address sinks connect to (default: this machine's address on
        its default route; the listener takes connections on every interface)."""
        super().__init__(worker_id, cache, compat, lease_s)
        self._worker = _worker()
        self._accepted: list[ucx_api.UCXEndpoint] = []
        self._listener = ucx_api.UCXListener.create(worker=self._worker, port=0, cb_func=self._accept)
        self.host = host or default_route_ip()
        # Python's sockets are not inherited by child processes (PEP 446), UCX's are: a
        # child that outlives this process keeps UCX's sockets open, never this one.
        self._probe = socket.create_server(("", 0))
        self._probe.setblocking(False)
        self._pairs: list[_Pair] = []
        self._numbers = TransferNumbers()

    def _accept(self, conn_request) -> None:  # runs inside worker.progress()
        self._accepted.append(self._listener.create_endpoint_from_conn_request(conn_request, True))

    def _payload(self) -> UcxPeerInfo:
        return UcxPeerInfo(self.host, self._listener.port, self._probe.getsockname()[1])

    def _publish(self, desc: KVDescriptor) -> UcxTicket:
        return UcxTicket(self._numbers.add(desc.transfer_id))

    def _unpublish(self, desc: KVDescriptor) -> None:
        self._numbers.remove(desc.payload.seq)

    def _progress(self) -> list[str]:
        while self._worker.progress():
            pass
        self._answer_probes()
        for ep in self._accepted:
            pair = _Pair(ep)
            pair.listen()
            self._pairs.append(pair)
        self._accepted.clear()
        confirmed: list[str] = []
        for pair in list(self._pairs):
            try:
                pair.reap()
                while (msg := pair.take()) is not None:
                    kind, seq, lo, hi, tag = msg
                    tid = self._numbers.get(seq)
                    if kind == CONFIRM and tid is not None:
                        confirmed.append(tid)
                    elif kind == PING:
                        pair.send(_message(OK), tag)
                    elif kind == PULL:
                        self._serve(pair, tid, lo, hi, tag)
            except _Failed as e:  # the sink closed or died: forget its endpoint
                log.info("ucx: a sink's endpoint closed (%s)", e)
                self._pairs.remove(pair)
        return confirmed

    def _answer_probes(self) -> None:
        """Accept and close the sinks' liveness probes (so the backlog never fills)."""
        while True:
            try:
                conn, _ = self._probe.accept()
            except OSError:  # BlockingIOError: none waiting
                return
            conn.close()

    def _serve(self, pair: _Pair, transfer_id: str | None, lo: int, hi: int, tag: int) -> None:
        layers = self.compat.layout.num_layers
        if transfer_id is None or not self._is_live(transfer_id) or not 0 <= lo < hi <= layers:
            pair.send(_message(GONE), tag)
            return
        desc = self._exports[transfer_id].descriptor
        data = pack(self.cache, self.compat.layout, desc.block_ids, desc.window_from, range(lo, hi))
        pair.send(_message(OK, data.numel() * data.element_size()), tag)
        pair.send(_bytes_of(data), tag + 1)

    def close(self) -> None:
        super().close()
        for pair in self._pairs:
            if pair.ep.alive:
                pair.ep.close()
        self._pairs.clear()
        self._probe.close()


class UcxSink(KVSink):
    backend = "ucx"
    chunked = True

    def __init__(
        self, worker_id: str, cache: torch.Tensor, compat: CompatInfo, *, connect_timeout_s: float = 30.0
    ):
        super().__init__(worker_id, cache, compat)
        self.connect_timeout_s = connect_timeout_s
        self._worker = _worker()
        self._eps: dict[str, ucx_api.UCXEndpoint] = {}  # by source worker id; absent once closed
        self._where: dict[str, UcxPeerInfo] = {}
        self._tag = uuid.uuid4().int & ((1 << 62) - 1)  # the next answer's tag (two per exchange)

    def _connect(self, hs: Handshake, replacing: Handshake | None) -> None:
        info = hs.payload
        if not isinstance(info, UcxPeerInfo):
            raise PeerLost(f"worker {hs.worker_id} sent no ucx address")
        self._drop(hs.worker_id)
        self._where[hs.worker_id] = info
        self._open(hs.worker_id, f"connecting to {hs.worker_id}", time.monotonic() + self.connect_timeout_s)

    def _open(self, source: str, what: str, deadline: float) -> ucx_api.UCXEndpoint:
        """The endpoint to ``source``, connected (a PING answered) if it was not."""
        ep = self._eps.get(source)
        if ep is not None:
            return ep
        info = self._where[source]
        try:
            ep = self._worker.create_endpoint_from_hostname(info.host, info.port, True)
        except Exception as e:
            raise PeerLost(f"{what}: cannot reach {info.host}:{info.port}: {e}") from e
        self._eps[source] = ep
        reply, _ = self._ask(source, (PING, 0, 0, 0), what, deadline)
        if reply[0] != OK:
            self._drop(source)
            raise PeerLost(f"{what}: {source} answered {reply.tolist()} to a ping")
        return ep

    def _drop(self, source: str) -> None:
        ep = self._eps.pop(source, None)
        if ep is not None and ep.alive:  # ucxx has closed a failed endpoint itself (closing again crashes)
            ep.close()

    def _send(self, source: str, buf: np.ndarray, what: str, deadline: float) -> None:
        self._wait(source, self._eps[source].stream_send(Array(buf)), what, deadline)

    def _ask(
        self, source: str, request: tuple[int, int, int, int], what: str, deadline: float
    ) -> tuple[np.ndarray, int]:
        """Send ``request``; wait for its answer's header. Returns the header and the tag
        the answer's data (if any) comes with."""
        tag, self._tag = self._tag, (self._tag + 2) & ((1 << 62) - 1)
        header = _message()
        answer = self._eps[source].tag_recv(Array(header), ucx_api.UCXXTag(tag))
        self._send(source, _message(*request, tag), what, deadline)
        self._wait(source, answer, what, deadline)
        return header, tag + 1

    def _wait(self, source: str, req: ucx_api.UCXRequest, what: str, deadline: float) -> None:
        """Progress until ``req`` completes. On any failure every request of this sink
        still posted is cancelled (none may later write into a buffer given up), the pair
        is closed (its request stream may be out of step), and ``TransferTimeout`` or
        ``PeerLost`` raised."""
        spins, probe_at = 0, time.monotonic() + PROBE_S
        try:
            while not req.completed:
                if self._worker.progress():
                    continue
                now = time.monotonic()
                if now > deadline:
                    raise TransferTimeout(f"{what} timed out")
                if now > probe_at:
                    probe_at = now + PROBE_S
                    if not self._listening(source):
                        raise PeerLost(f"{what}: {source} is gone")
                spins += 1
                if spins > _SPINS:
                    time.sleep(0.0002)
            _check(req)
        except _Failed as e:
            self._give_up(source)
            raise PeerLost(f"{what}: the endpoint to {source} failed ({e})") from None
        except KVTransferError:
            self._give_up(source)
            raise

    def _give_up(self, source: str) -> None:
        self._worker.cancel_inflight_requests()
        self._drop(source)

    def _listening(self, source: str) -> bool:
        """False once nothing accepts connections at the source's probe port: its process
        is gone (a fresh TCP connection to a socket no child process can inherit, so UCX
        sockets that a child of a dead source keeps open cannot hide that)."""
        info = self._where[source]
        return accepts_connections(info.host, info.probe_port, PROBE_S)

    def _transfer(self, desc: KVDescriptor, dst_blocks: list[int], deadline: float, layers: range) -> None:
        source, what = desc.source_worker, f"KV transfer {desc.transfer_id} from {desc.source_worker}"
        self._open(source, what, deadline)
        request = (PULL, desc.payload.seq, layers.start, layers.stop)
        header, data_tag = self._ask(source, request, what, deadline)
        if header[0] != OK:
            raise LeaseExpired(f"{source} no longer holds {desc.transfer_id}")
        c, lay = self.cache, self.compat.layout
        row = c[0, :, 0].numel()  # one layer's K/V of one block
        groups = lay.layer_runs(layers, len(dst_blocks), desc.window_from)
        data = torch.empty(sum((hi - lo) * (b - a) * row for lo, hi, a, b in groups), dtype=c.dtype)
        if data.numel() * data.element_size() != int(header[1]):
            raise KVTransferError(
                f"{source} announced {int(header[1])} bytes for {desc.transfer_id}, not the layout's"
            )
        received = self._eps[source].tag_recv(Array(_bytes_of(data)), ucx_api.UCXXTag(data_tag))
        self._wait(source, received, what, deadline)
        unpack(c, lay, dst_blocks, desc.window_from, layers, data)

    def _confirm(self, desc: KVDescriptor) -> bool:
        source, what = desc.source_worker, f"confirming {desc.transfer_id}"
        deadline = time.monotonic() + self.connect_timeout_s
        try:
            self._open(source, what, deadline)
            self._send(source, _message(CONFIRM, desc.payload.seq), what, deadline)
            return True
        except KVTransferError:
            log.warning("could not confirm %s over ucx", desc.transfer_id, exc_info=True)
            return False

    def close(self) -> None:
        super().close()
        for source in list(self._eps):
            self._drop(source)
