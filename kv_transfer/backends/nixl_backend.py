"""``nixl``: NVIDIA Inference Xfer Library (UCX backend), one-sided READ by the sink.

Each worker registers its whole KV cache tensor once (DRAM on CPU, VRAM on
GPU). The handshake carries the source's NIXL agent metadata and the cache's
base address; a sink adds the source as a remote agent, then pulls a request
with one READ whose descriptors are built by address arithmetic: one
descriptor per (layer, K/V, run of blocks contiguous on both sides). After
verifying, the sink confirms with a NIXL notification ``ok:<transfer_id>``,
which the source picks up in ``poll()``.

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

from splitserve.kv_transfer.contract import CompatInfo, Handshake, KVDescriptor
from splitserve.kv_transfer.errors import KVTransferError, PeerLost, TransferTimeout
from splitserve.kv_transfer.integrity import paired_runs
from splitserve.kv_transfer.sink import KVSink
from splitserve.kv_transfer.source import KVSource

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


def _make_agent(name: str, cache: torch.Tensor):
    api = _nixl_api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise KVTransferError("NIXL has no UCX backend on this machine")
    reg = agent.register_memory(cache)
    if reg is None:
        raise KVTransferError("NIXL could not register the KV cache")
    return agent, reg


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


class NixlSource(KVSource):
    backend = "nixl"

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo, lease_s: float = 30.0):
        super().__init__(worker_id, cache, compat, lease_s)
        self.agent, self._reg = _make_agent(f"{worker_id}/{self.incarnation}", cache)

    def _payload(self) -> NixlPeerInfo:
        mem, dev = _mem(self.cache)
        return NixlPeerInfo(
            self.agent.get_agent_metadata(), self.cache.data_ptr(), self.cache.shape[2], mem, dev
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
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None


class NixlSink(KVSink):
    backend = "nixl"

    def __init__(self, worker_id: str, cache: torch.Tensor, compat: CompatInfo):
        super().__init__(worker_id, cache, compat)
        self.incarnation = f"{time.time_ns():x}"
        self.agent, self._reg = _make_agent(f"{worker_id}/sink/{self.incarnation}", cache)
        self._remote: dict[str, tuple[str, NixlPeerInfo]] = {}  # worker id -> (agent name, info)

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
        self, desc: KVDescriptor, dst_blocks: list[int], info: NixlPeerInfo
    ) -> tuple[np.ndarray, np.ndarray]:
        block_bytes = self.compat.layout.block_bytes
        pairs = np.array(paired_runs(desc.block_ids, dst_blocks), dtype=np.uint64).reshape(-1, 3)
        planes = np.arange(self.cache.shape[0] * 2, dtype=np.uint64)[:, None]  # (layer, k/v)
        src_off = (planes * np.uint64(info.num_blocks) + pairs[None, :, 0]) * np.uint64(block_bytes)
        dst_off = (planes * np.uint64(self.cache.shape[2]) + pairs[None, :, 1]) * np.uint64(block_bytes)
        lengths = np.broadcast_to(pairs[None, :, 2] * np.uint64(block_bytes), src_off.shape)
        _, dev = _mem(self.cache)
        local = np.stack(
            [dst_off + np.uint64(self.cache.data_ptr()), lengths, np.full_like(dst_off, dev)], axis=-1
        ).reshape(-1, 3)
        remote = np.stack(
            [src_off + np.uint64(info.base_addr), lengths, np.full_like(src_off, info.device_id)], axis=-1
        ).reshape(-1, 3)
        return local, remote

    def _transfer(self, desc: KVDescriptor, dst_blocks: list[int], deadline: float) -> None:
        peer, info = self._remote[desc.source_worker]
        local, remote = self._descs(desc, dst_blocks, info)
        mem, _ = _mem(self.cache)
        try:
            handle = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local, mem),
                self.agent.get_xfer_descs(remote, info.mem_type),
                peer,
            )
        except Exception as e:
            raise PeerLost(f"cannot read KV from {desc.source_worker}: {e}") from e
        try:
            state = self.agent.transfer(handle)
            spins = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferTimeout(
                        f"KV transfer {desc.transfer_id} from {desc.source_worker} timed out"
                    )
                spins += 1
                if spins > 1000:
                    time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerLost(f"KV transfer {desc.transfer_id} from {desc.source_worker} failed ({state})")
        except KVTransferError:
            raise
        except Exception as e:
            raise PeerLost(f"KV transfer {desc.transfer_id} from {desc.source_worker} failed: {e}") from e
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                log.debug("releasing a NIXL transfer handle failed", exc_info=True)

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
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
