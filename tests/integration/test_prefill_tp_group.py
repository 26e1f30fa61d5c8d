"""A TP prefill group without Ray: ``PrefillWorker`` (rank 0) in this process and a
``PrefillRank`` in a spawned one. The group outlives idle periods longer than its
collective timeout (rank 0 sends heartbeats), and each result carries rank 1's
KV shard."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import time

from splitserve.engine import EngineConfig, SamplingParams
from splitserve.engine.parallel import TPInit
from splitserve.prefill_worker import PrefillTask, PrefillWorker, PrefillWorkerSpec
from tests.conftest import make_hf_checkpoint, random_prompts
from tests.integration.tp_ranks import free_port, prefill_rank_main

TIMEOUT_S = 8.0  # the group's collective timeout: an unheard-from rank fails after it


def test_idle_group_survives_its_timeout_and_exports_every_shard(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    engine = EngineConfig(model=str(tmp_path), dtype="float32", tp_size=2, num_kv_blocks=64)
    address = f"tcp://127.0.0.1:{free_port()}"
    spec = PrefillWorkerSpec("p", engine, "nixl", torch_threads=1, tp=TPInit(0, 2, address, TIMEOUT_S))
    rank1_spec = dataclasses.replace(spec, tp=TPInit(1, 2, address, TIMEOUT_S))
    rank1 = mp.get_context("spawn").Process(target=prefill_rank_main, args=(rank1_spec,))
    rank1.start()
    worker = PrefillWorker(spec)
    try:
        time.sleep(1.5 * TIMEOUT_S)  # idle: without heartbeats rank 1's receive would time out
        assert rank1.is_alive()
        prompt = random_prompts([40], 512)[0]
        result = asyncio.run(worker.prefill(PrefillTask("r1", prompt, SamplingParams(max_tokens=4))))
        (shard,) = result.shards
        assert (
            shard.descriptor.request_id == "r1" and shard.descriptor.block_ids == result.descriptor.block_ids
        )
        assert shard.handshake.compat.layout.tp_rank == 1
        assert result.descriptor.checksum != shard.descriptor.checksum  # different heads, different bytes
    finally:
        worker.shutdown()
        rank1.join(30)
    assert rank1.exitcode == 0
