"""A colocated worker as a TP group without Ray: the ``DecodeWorker`` (rank 0) in
this process and a ``DecodeRank`` in a spawned one. Requests run through the
worker's own API (``start`` and ``stream``) give the TP=1 engine's greedy
tokens, a request resumed with tokens already sent continues them exactly, and
the group outlives an idle period longer than its collective timeout (rank 0
sends heartbeats)."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import time

from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeTask, DecodeWorkerSpec
from splitserve.wire.sampling import SamplingParams
from splitserve.wire.tp import TPInit
from tests.conftest import make_hf_checkpoint, random_prompts
from tests.integration.tp_ranks import decode_rank_main, free_port

TIMEOUT_S = 6.0  # the group's collective timeout: an unheard-from rank fails after it


async def _run(worker: DecodeWorker, tasks: list[DecodeTask]) -> dict[str, list[int]]:
    """Start ``tasks`` on one outbox and read it until each has ended; tokens by request."""
    tokens: dict[str, list[int]] = {t.request_id: [] for t in tasks}
    for task in tasks:
        await worker.start("test", task)
    left = set(tokens)
    stream = worker.stream("test")
    while left:
        for batch in await anext(stream):
            assert batch.error is None, batch.error
            tokens[batch.request_id] += batch.token_ids
            if batch.finish_reason is not None:
                left.discard(batch.request_id)
    await stream.aclose()
    return tokens


def test_a_colocated_tp2_group_decodes_resumes_and_idles_like_tp1(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    engine = EngineConfig(model=str(tmp_path), dtype="float32", tp_size=2, num_kv_blocks=128)
    address = f"tcp://127.0.0.1:{free_port()}"
    spec = DecodeWorkerSpec("c", engine, None, 10.0, 8, torch_threads=1, tp=TPInit(0, 2, address, TIMEOUT_S))
    rank1 = mp.get_context("spawn").Process(
        target=decode_rank_main, args=(dataclasses.replace(spec, tp=TPInit(1, 2, address, TIMEOUT_S)),)
    )
    rank1.start()
    reference = Engine(dataclasses.replace(engine, tp_size=1))
    prompts = random_prompts([5, 40, 90], 512, seed=3)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 7, 20)]
    expected = [c.token_ids for c in reference.generate(prompts, params)]
    worker = DecodeWorker(spec)
    try:
        tasks = [DecodeTask(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        got = asyncio.run(_run(worker, tasks))
        assert [got[t.request_id] for t in tasks] == expected
        time.sleep(1.5 * TIMEOUT_S)  # idle: without heartbeats rank 1's receive would time out
        assert rank1.is_alive()
        # resumed after 5 tokens were sent elsewhere: the rest, as the undisturbed run
        resumed = DecodeTask("again", prompts[2], params[2], output_token_ids=expected[2][:5])
        assert asyncio.run(_run(worker, [resumed]))["again"] == expected[2][5:]
    finally:
        worker.shutdown()
        rank1.join(30)
    assert rank1.exitcode == 0
