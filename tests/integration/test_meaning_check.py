"""The meaning check through a real handoff (``transfer.verify_meaning``): a prefill
worker and a decode worker in this process, KV over NIXL, the router's dispatcher in
front. Every request's KV is checked before it runs; a placement fault injected on the
decode side (the blocks the KV lands in, reversed against the request's block table:
the bytes and their checksums are the source's) is caught as a failed transfer, the
request is recomputed to the monolithic engine's tokens, the worker counts the
mismatch, and no block stays held."""

from __future__ import annotations

import asyncio

from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeWorkerSpec
from splitserve.wire.prefill import PrefillWorkerSpec
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.in_process import blocks_held, handing_over, run
from tests.waiting import wait_until

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
DEADLINE_S = 300


def test_every_handoff_is_checked_and_a_placement_fault_is_recomputed(checkpoint):
    engine = EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=128, block_size=8)
    prompts = random_prompts([37, 29, 41], 512, seed=5)
    want = [c.token_ids for c in Engine(engine).generate(prompts, PARAMS)]
    prefill = PrefillWorker(PrefillWorkerSpec("prefill-0", engine, "nixl", 30.0, torch_threads=1))
    spec = DecodeWorkerSpec("decode-0", engine, "nixl", 30.0, 8, torch_threads=1, verify_meaning=1.0)
    decode = DecodeWorker(spec)
    side = decode._side
    pull = side.pull
    faulted = []

    async def reversed_pull(handoff, blocks, timeout):  # the placement fault, for one request
        if handoff.descriptors[0].request_id == "faulted":
            faulted.append(list(blocks))
            blocks = blocks[::-1]
        return await pull(handoff, blocks, timeout)

    side.pull = reversed_pull

    async def serve():
        d = await handing_over(prefill, decode, "tiny")
        got = {}
        for rid, prompt in zip(("a", "faulted", "b"), prompts):
            tokens, _, reason = await run(d, rid, prompt, PARAMS)
            got[rid] = (tokens, reason, d.traces.latest(1)[0])
        return got, await decode.stats()

    try:
        got, stats = asyncio.run(asyncio.wait_for(serve(), DEADLINE_S))
        assert [got[r][0] for r in ("a", "faulted", "b")] == want
        assert faulted and len(faulted[0]) >= 2  # the fault was injected, across blocks
        checks = dict(stats.engine.meaning_checks)
        assert checks == {"ok": 2, "mismatch": 1}, checks
        # the faulted request was recomputed by the decode worker: no pull reported for it
        trace = got["faulted"][2]
        assert "kv_recompute" in [m.name for m in trace.marks], trace.marks
        for worker in (prefill, decode):
            wait_until(lambda w=worker: blocks_held(w) == 0, "the worker freed every block", 60)
    finally:
        decode.shutdown()
        prefill.shutdown()
