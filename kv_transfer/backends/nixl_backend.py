"""``nixl``: NVIDIA Inference Xfer Library (UCX backend), one-sided READ by the sink.

Each worker registers its whole KV cache tensor once (DRAM on CPU, VRAM on
GPU), and a source also its progress board (host memory). The handshake
carries the source's NIXL agent metadata and both base addresses; a sink adds
the source as a remote agent, then pulls a request with one READ per chunk of
layers, whose descriptors are built by address arithmetic: one descriptor per
(layer, K/V, run of blocks contiguous on both sides). A streamed export's
progress is one more (small) READ of its board row into a registered buffer
of the sink's. After verifying, the sink confirms with a NIXL notification
``ok:<transfer_id>``, which the source picks up in ``poll()``.

Progress: agents run without a progress thread (``enable_prog_thread=False``,
~2.7x faster on a 2-core machine), so the source must call ``poll()``
regularly, also when idle: connection set-up and non-zero-copy transports
(tcp) need the source's side to progress. On one host UCX reads the source's
memory directly (cma), so later READs need nothing from the source.

A READ is one-sided: the source cannot refuse a read of blocks whose lease
ended. The sink checks the lease before and after the READ, and the checksum
catches a block reused meanwhile.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.kv_transfer.integrity import paired_runs
from splitserve.kv_transfer.progress import parse_row
from splitserve.kv_transfer.sink import KVSink
from splitserve.kv_transfer.source import KVSource
from splitserve.wire.errors import KVTransferError, PeerLost, TransferTimeout
from splitserve.wire.kv import CompatInfo, Handshake, KVDescriptor, LayerProgress

log = logging.getLogger(__name__)

_CONFIRM = b"ok:"


def _nixl_api():
    """``nixl._api`` (the ``nixl`` meta package) or a CUDA-specific wheel's copy of it."""
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("the nixl backend needs NIXL: pip install nixl-cu12 (or nixl)")


# UCX settings for a cache on a GPU. The sink pulls with a READ (UCX's GET), and UCX 1.23
# (nixl 1.5.1's) turns cuda_ipc's GET zero-copy off where NVML shows no active NVLink
# (``CUDA_IPC_ENABLE_GET_ZCOPY=auto``): the pull then falls back to 8 KiB active messages
# over TCP, ~0.4 GB/s GPU to GPU on one H200 (``shared/notes/gpu-kv-path.md``). On: the
# pull is one device-to-device copy per descriptor. The environment still wins
# (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``), as UCX applies it over a backend's config.
GPU_UCX_CONFIG = "CUDA_IPC_ENABLE_GET_ZCOPY=y"


def _make_agent(name: str, cache: torch.Tensor, board: torch.Tensor):
    """An agent with ``cache`` and ``board`` (a host tensor) registered; its UCX backend
    made with ``GPU_UCX_CONFIG`` for a cache on a GPU."""
    api = _nixl_api()
    if cache.is_cuda:
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", {"engine_config": GPU_UCX_CONFIG})
    else:
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise KVTransferError("NIXL has no UCX backend on this machine")
    regs = [agent.register_memory(cache), agent.register_memory(board)]
    if any(r is None for r in regs):
        raise KVTransferError("NIXL could not register the KV cache")
    return agent, regs


def _wait(agent, handle, what: str, deadline: float) -> None:
    """Post a prepared transfer and drive it to DONE (``TransferTimeout`` past ``deadline``,
    ``PeerLost`` if it fails); always releases the handle."""
    try:
        state = agent.transfer(handle)
        spins = 0
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TransferTimeout(f"{what} timed out")
            spins += 1
            if spins > 1000:
                time.sleep(0.0002)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise PeerLost(f"{what} failed ({state})")
    except KVTransferError:
        raise
    except Exception as e:
        raise PeerLost(f"{what} failed: {e}") from e
    finally:
        try:
            agent.release_xfer_handle(handle)
        except Exception:
            log.debug("releasing a NIXL transfer handle failed", exc_info=True)


def _mem(cache: torch.Tensor) -> tuple[str, int]:
    if cache.device.type == "cpu":
        return "DRAM", 0
    return "VRAM", cache.device.index or 0


@dataclass(frozen=True)
class NixlPeerInfo:
    agent_metadata: bytes
    base_addr: int
    num_blocks: int
    mem_type: str
    device_id: int
    board_addr: int  # the progress board (host memory), rows of ProgressBoard.row_bytes


class NixlSource(KVSource):
    backend = "nixl"
    streams = True

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo, lease_s: float):
        super().__init__(worker_id, cache, compat, lease_s)
        self.agent, self._reg = _make_agent(f"{worker_id}/{self.incarnation}", cache, self.board.tensor)

    def _payload(self) -> NixlPeerInfo:
        mem, dev = _mem(self.cache)
        return NixlPeerInfo(
            self.agent.get_agent_metadata(),
            self.cache.data_ptr(),
            self.cache.shape[2],
            mem,
            dev,
            self.board.tensor.data_ptr(),
        )

    def _progress(self) -> list[str]:
        confirmed = []
        for msgs in self.agent.get_new_notifs().values():
            for m in msgs:
                if m.startswith(_CONFIRM):
                    confirmed.append(m[len(_CONFIRM) :].decode())
        return confirmed

    def close(self) -> None:
        super().close()
        for reg in self._reg:
            self.agent.deregister_memory(reg)
        self._reg = []


class NixlSink(KVSink):
    backend = "nixl"
    chunked = True

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo):
        super().__init__(worker_id, cache, compat)
        self.incarnation = f"{time.time_ns():x}"
        self._row = torch.zeros(2 + compat.layout.num_layers, dtype=torch.int64)  # board reads land here
        self.agent, self._reg = _make_agent(f"{worker_id}/sink/{self.incarnation}", cache, self._row)
        self._remote: dict[str, tuple[str, NixlPeerInfo]] = {}  # worker id -> (agent name, info)
        self._plan: tuple | None = None  # the last pull's (key, local rows, remote rows, layer starts)

    def _connect(self, hs: Handshake, replacing: Handshake | None) -> None:
        info = hs.payload
        if not isinstance(info, NixlPeerInfo):
            raise PeerLost(f"worker {hs.worker_id} sent no NIXL metadata")
        if replacing is not None and hs.worker_id in self._remote:
            try:
                self.agent.remove_remote_agent(self._remote.pop(hs.worker_id)[0])
            except Exception:  # the old incarnation may already be unknown to NIXL
                log.debug("removing the old NIXL agent of %s failed", hs.worker_id, exc_info=True)
        name = self.agent.add_remote_agent(info.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._remote[hs.worker_id] = (name, info)

    def _descs(
        self, desc: KVDescriptor, dst_blocks: list[int], info: NixlPeerInfo, layers: range
    ) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) descriptor rows of ``layers``: one per (layer, K/V, run of
        blocks contiguous on both sides; a sliding layer's from ``desc.window_from``).
        The rows of every layer are built once per pull (the chunks of one pull share
        them)."""
        key = (desc.transfer_id, tuple(dst_blocks))
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, *self._all_descs(desc, dst_blocks, info))
        _, local, remote, starts = self._plan
        rows = slice(starts[layers.start], starts[layers.stop])
        return local[rows], remote[rows]

    def _all_descs(
        self, desc: KVDescriptor, dst_blocks: list[int], info: NixlPeerInfo
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every layer's rows, in layer order, and the row each layer starts at (one more
        entry: the end). Built per set of layers that move the same ids (all of them, or
        the full and the sliding ones, or each layer group's: ``KVLayout.layer_span``),
        each layer at its row of the tensor, then put in layer order."""
        lay = self.compat.layout
        block_bytes = np.uint64(lay.block_bytes)
        spans = [lay.layer_span(layer, len(dst_blocks), desc.window_from) for layer in range(lay.num_layers)]
        tensor_rows = np.array([lay.row(layer) for layer in range(lay.num_layers)], dtype=np.uint64)
        plane_ids, src_parts, dst_parts, len_parts = [], [], [], []
        for start, stop in sorted(set(spans)):
            runs = paired_runs(desc.block_ids[start:stop], dst_blocks[start:stop])
            pairs = np.array(runs, dtype=np.uint64).reshape(-1, 3)
            layers = np.array([i for i, s in enumerate(spans) if s == (start, stop)], dtype=np.uint64)
            plane_range = np.arange(lay.planes, dtype=np.uint64)
            order_key = (layers[:, None] * np.uint64(lay.planes) + plane_range).reshape(-1, 1)
            rows = tensor_rows[layers.astype(np.int64)]
            planes = (rows[:, None] * np.uint64(lay.planes) + plane_range).reshape(-1, 1)
            plane_ids.append(np.broadcast_to(order_key, (len(planes), len(pairs))).reshape(-1))
            src_parts.append(
                ((planes * np.uint64(info.num_blocks) + pairs[None, :, 0]) * block_bytes).reshape(-1)
            )
            dst_parts.append(
                ((planes * np.uint64(self.cache.shape[2]) + pairs[None, :, 1]) * block_bytes).reshape(-1)
            )
            len_parts.append(
                np.broadcast_to(pairs[None, :, 2] * block_bytes, (len(planes), len(pairs))).reshape(-1)
            )
        plane_of = np.concatenate(plane_ids)
        order = np.argsort(plane_of, kind="stable")  # (layer, K/V, run), as the checksums read them
        src_off, dst_off, lengths = (np.concatenate(p)[order] for p in (src_parts, dst_parts, len_parts))
        _, dev = _mem(self.cache)
        local = np.stack(
            [dst_off + np.uint64(self.cache.data_ptr()), lengths, np.full_like(dst_off, dev)], axis=-1
        )
        remote = np.stack(
            [src_off + np.uint64(info.base_addr), lengths, np.full_like(src_off, info.device_id)], axis=-1
        )
        layer_of = plane_of[order] // np.uint64(lay.planes)
        starts = np.searchsorted(layer_of, np.arange(lay.num_layers + 1, dtype=np.uint64))
        return local, remote, starts

    def _read(
        self, desc: KVDescriptor, local, local_mem: str, remote, remote_mem: str, deadline: float, what: str
    ):
        peer, _ = self._remote[desc.source_worker]
        try:
            handle = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local, local_mem),
                self.agent.get_xfer_descs(remote, remote_mem),
                peer,
            )
        except Exception as e:
            raise PeerLost(f"cannot read {what} from {desc.source_worker}: {e}") from e
        _wait(self.agent, handle, f"reading {what} from {desc.source_worker}", deadline)

    def _transfer(self, desc: KVDescriptor, dst_blocks: list[int], deadline: float, layers: range) -> None:
        _, info = self._remote[desc.source_worker]
        local, remote = self._descs(desc, dst_blocks, info, layers)
        mem, _ = _mem(self.cache)
        what = f"layers {layers.start}-{layers.stop - 1} of KV transfer {desc.transfer_id}"
        self._read(desc, local, mem, remote, info.mem_type, deadline, what)

    def _progress(self, desc: KVDescriptor, deadline: float) -> LayerProgress:
        _, info = self._remote[desc.source_worker]
        nbytes = self._row.numel() * 8
        local = np.array([[self._row.data_ptr(), nbytes, 0]], dtype=np.uint64)
        remote = np.array([[info.board_addr + desc.stream.slot * nbytes, nbytes, 0]], dtype=np.uint64)
        self._read(desc, local, "DRAM", remote, "DRAM", deadline, f"the progress of {desc.transfer_id}")
        return parse_row(self._row.tolist(), desc.stream, desc.transfer_id)

    def _confirm(self, desc: KVDescriptor) -> bool:
        try:
            self.agent.send_notif(self._remote[desc.source_worker][0], _CONFIRM + desc.transfer_id.encode())
            return True
        except Exception:
            log.warning(
                "could not notify %s of %s; confirm through the control plane",
                desc.source_worker,
                desc.transfer_id,
                exc_info=True,
            )
            return False

    def close(self) -> None:
        super().close()
        for reg in self._reg:
            self.agent.deregister_memory(reg)
        self._reg = []
