"""The ``ucx`` backend's protocol in one process: a source polled by a thread of
its own (as a prefill worker's poller does), a sink pulling in chunks of layers.
Two-process correctness and failure cases are in
``tests/integration/test_kv_transfer_processes.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.integrity import layer_checksums
from splitserve.wire.errors import LeaseExpired
from splitserve.wire.kv import CompatInfo, TransferState
from splitserve.wire.kv_layout import KVLayout
from tests.waiting import wait_until

LAYOUT = KVLayout(num_layers=6, num_blocks=24, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
COMPAT = CompatInfo(model="random", layout=LAYOUT)


def _cache(fill: bool) -> torch.Tensor:
    shape = (LAYOUT.num_layers, 2, LAYOUT.num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape).to(torch.bfloat16) if fill else torch.zeros(shape, dtype=torch.bfloat16)


class PolledSource:
    """A ucx source with a thread calling ``poll`` every millisecond; lease ends collected."""

    def __init__(self):
        self.source = get_backend("ucx").source("prefill-0", _cache(fill=True), COMPAT, 30.0)
        self.lock = threading.Lock()
        self.ended = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            with self.lock:
                self.ended += self.source.poll()
            time.sleep(0.001)

    def ended_for(self, transfer_id: str, timeout: float = 30.0):
        def found() -> list:
            with self.lock:
                return [e for e in self.ended if e.transfer_id == transfer_id]

        wait_until(found, f"the lease of {transfer_id} ended", timeout, 0.01)
        return found()[0]

    def close(self):
        self._stop.set()
        self._thread.join(10)
        self.source.close()


@pytest.fixture
def peers():
    src = PolledSource()
    sink = get_backend("ucx").sink("decode-0", _cache(fill=False), COMPAT)
    sink.MIN_CHUNK_BYTES = 1  # a chunk per layer: several requests on one endpoint
    sink.connect(src.source.handshake())
    yield src, sink
    sink.close()
    src.close()


def test_pull_moves_the_blocks_in_chunks_and_confirms(peers):
    src, sink = peers
    with src.lock:
        desc = src.source.export("r1", [3, 4, 5, 17], 60)
    dst = [0, 9, 2, 11]
    conf = sink.pull(desc, dst, timeout=30.0)
    assert conf.delivered
    assert torch.equal(sink.cache[:, :, dst], src.source.cache[:, :, [3, 4, 5, 17]])
    assert layer_checksums(sink.cache, dst) == desc.layer_checksums
    assert src.ended_for(desc.transfer_id).state == TransferState.CONFIRMED
    # the endpoint is still in step for the next request
    with src.lock:
        desc2 = src.source.export("r2", [7], 10)
    sink.pull(desc2, [20], timeout=30.0)
    assert torch.equal(sink.cache[:, :, 20], src.source.cache[:, :, 7])


def test_a_released_export_is_refused_and_the_link_keeps_working(peers):
    src, sink = peers
    with src.lock:
        gone = src.source.export("r1", [1, 2], 20)
        src.source.release(gone.transfer_id)
        kept = src.source.export("r2", [6, 8], 20)
    with pytest.raises(LeaseExpired):
        sink.pull(gone, [0, 1], timeout=30.0)
    sink.pull(kept, [4, 5], timeout=30.0)
    assert torch.equal(sink.cache[:, :, [4, 5]], src.source.cache[:, :, [6, 8]])


def test_importing_the_backend_leaves_the_environment_alone():
    """ucxx sets ``UCX_*`` variables when imported; they would reach every UCX context
    the process makes later (NIXL's too). The backend puts the environment back."""
    code = (
        "import os; before = dict(os.environ)\n"
        "import splitserve.kv_transfer.backends.ucx_backend\n"
        "added = sorted(set(os.environ) - set(before))\n"
        "changed = sorted(k for k in before if os.environ.get(k) != before[k])\n"
        "assert not added and not changed, (added, changed)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
