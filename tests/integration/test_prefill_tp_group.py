"""A TP prefill group without Ray: ``PrefillWorker`` (rank 0) in this process and a
``PrefillRank`` in a spawned one. The group outlives idle periods longer than its
collective timeout (rank 0 sends heartbeats), each result's handoff carries
rank 1's KV shard, and confirmations delivered through the control plane
(``confirm``, as the router does for the ray backend) end both ranks' leases."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import time

import pytest

from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.kv import Confirmation
from splitserve.wire.prefill import PrefillTask, PrefillWorkerSpec
from splitserve.wire.sampling import SamplingParams
from splitserve.wire.tp import TPInit
from tests.conftest import make_hf_checkpoint, random_prompts
from tests.integration.tp_ranks import free_port, prefill_rank_main
from tests.waiting import wait_until

TIMEOUT_S = 8.0  # the group's collective timeout: an unheard-from rank fails after it


def test_idle_group_survives_its_timeout_and_exports_every_shard(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    engine = EngineConfig(model=str(tmp_path), dtype="float32", tp_size=2, num_kv_blocks=64)
    address = f"tcp://127.0.0.1:{free_port()}"
    spec = PrefillWorkerSpec("p", engine, "nixl", 300.0, torch_threads=1, tp=TPInit(0, 2, address, TIMEOUT_S))
    rank1_spec = dataclasses.replace(spec, tp=TPInit(1, 2, address, TIMEOUT_S))
    rank1 = mp.get_context("spawn").Process(target=prefill_rank_main, args=(rank1_spec,))
    rank1.start()
    worker = PrefillWorker(spec)
    try:
        time.sleep(1.5 * TIMEOUT_S)  # idle: without heartbeats rank 1's receive would time out
        assert rank1.is_alive()
        prompt = random_prompts([40], 512)[0]
        result = asyncio.run(worker.prefill(PrefillTask("r1", prompt, SamplingParams(max_tokens=4))))
        own, shard = result.handoff.descriptors
        assert shard.request_id == "r1" and shard.block_ids == own.block_ids
        assert shard.source_worker == "p/tp1" and shard.source_incarnation != own.source_incarnation
        assert [hs.compat.layout.tp_rank for hs in asyncio.run(worker.info()).handshakes] == [0, 1]
        assert own.layer_checksums != shard.layer_checksums  # different heads, different bytes
        assert asyncio.run(worker.stats()).exports == ("r1",)
        confirmations = tuple(Confirmation(d.transfer_id, d.source_worker, False) for d in (own, shard))
        asyncio.run(worker.confirm(confirmations))
        # both ranks' leases must end
        wait_until(lambda: not asyncio.run(worker.stats()).exports, "the exports released", 60, 0.01)
        stats = asyncio.run(worker.stats())
        assert (stats.leases_confirmed, stats.leases_expired, stats.leases_released) == (1, 0, 0)
        assert stats.engine.num_free_blocks == stats.engine.num_blocks
        # a decode group whose size the model's 2 KV heads do not split over is refused
        # before anything is held
        with pytest.raises(InvalidRequest, match="no decode group of TP=3"):
            asyncio.run(worker.prefill(PrefillTask("r2", prompt, SamplingParams(max_tokens=4), reader_tp=3)))
        assert asyncio.run(worker.stats()).engine.num_free_blocks == stats.engine.num_blocks
    finally:
        worker.shutdown()
        rank1.join(30)
    assert rank1.exitcode == 0
