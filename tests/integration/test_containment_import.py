"""A request failing alone on a decode worker while another request's KV streams in:
a ``PrefillWorker`` (layer-wise streaming over NIXL) and a ``DecodeWorker`` in this
process, no Ray. While a request's import is in flight (prefilled on the prefill
worker, its KV streamed and pulled), another request's sampling raises on the
decode worker: that one ends with its ``SequenceFailed``; the imported one's KV
lands (a pull was reported) and its tokens, like a third request's, equal the
monolithic engine's; the worker serves on and holds no block afterwards."""

from __future__ import annotations

import asyncio

from splitserve.decode_worker.handover import Phase
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeTask, DecodeWorkerSpec
from splitserve.wire.errors import SequenceFailed
from splitserve.wire.prefill import PrefillWorkerSpec
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.faults import Injected
from tests.waiting import wait_until

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
# the local request decodes on while the import is prefilled and pulled, however slow the
# machine: it ends at the fault, long before these tokens (CI once saw it end first)
LOCAL = SamplingParams(max_tokens=600, ignore_eos=True)
DEADLINE_S = 300  # a broken hook must fail the test, not hang it


def test_a_sequence_failing_alone_leaves_a_streamed_import_in_flight_whole(checkpoint):
    engine = EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64)
    prompts = random_prompts([30, 300, 50], 512, seed=21)
    expected = [c.token_ids for c in Engine(engine).generate(prompts, [LOCAL, PARAMS, PARAMS])]
    source = PrefillWorkerSpec("prefill-0", engine, "nixl", 30.0, torch_threads=1, stream_kv=True)
    prefill = PrefillWorker(source)
    decode = DecodeWorker(DecodeWorkerSpec("decode-0", engine, "nixl", 30.0, 8, torch_threads=1))
    seen_in_flight = []

    # the local request's sampling raises at its first step while the import's KV is pulled
    sampler = decode.engine.runner.sampler
    sample_batch = sampler._sample_batch

    def state() -> Phase | None:
        req = decode.requests.get("imported")
        return req.handover.phase if req is not None else None

    def failing(logits, rows):
        in_flight = state() == Phase.PULLING
        if in_flight and any(r.token_ids[: len(prompts[0])] == prompts[0] for r in rows if r.token_ids):
            seen_in_flight.append(state())
            raise Injected("sampling broke")
        return sample_batch(logits, rows)

    sampler._sample_batch = failing

    # the import's pull stays in flight (its bytes landed) until the fault met it: the two
    # overlap whatever the machine's speed (a pull faster than a decode step would not)
    sink = decode.puller.sink
    pull = sink.pull

    def held_pull(*args, **kwargs):
        result = pull(*args, **kwargs)
        wait_until(lambda: bool(seen_in_flight), "the local request's sampling met the pull", 120, 0.01)
        return result

    sink.pull = held_pull

    async def run() -> dict:
        tasks = [
            DecodeTask("local", prompts[0], LOCAL),
            DecodeTask("imported", prompts[1], PARAMS, source=prefill),
            DecodeTask("bystander", prompts[2], PARAMS),
        ]
        got = {t.request_id: {"tokens": [], "error": None, "pulled": False} for t in tasks}
        stream = decode.stream("test")
        await decode.start("test", tasks[0])
        await decode.start("test", tasks[2])
        while not got["local"]["tokens"]:  # the local request is decoding before the import begins
            for batch in await anext(stream):
                got[batch.request_id]["tokens"] += batch.token_ids
        await decode.start("test", tasks[1])
        left = set(got) - {r for r, g in got.items() if g["error"]}
        while left:
            for batch in await anext(stream):
                g = got[batch.request_id]
                g["tokens"] += batch.token_ids
                g["pulled"] |= batch.transfer_s is not None
                if batch.error is not None:
                    g["error"] = batch.error
                if batch.finish_reason is not None or batch.error is not None:
                    left.discard(batch.request_id)
        await stream.aclose()
        return got

    try:
        got = asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
        assert seen_in_flight, "the fault never met an import in flight"
        print(f"the import was {seen_in_flight[0]} when the other request failed")
        local = got["local"]
        assert isinstance(local["error"], SequenceFailed) and local["error"].kind == "sampling"
        assert local["tokens"] == expected[0][: len(local["tokens"])]
        assert got["imported"]["pulled"] and got["imported"]["error"] is None
        assert got["imported"]["tokens"] == expected[1]
        assert got["bystander"]["tokens"] == expected[2]
        del sampler._sample_batch
        stats = asyncio.run(decode.stats())
        assert stats.engine.num_running == 0 and decode.loop.error is None
        assert dict(stats.engine.sequence_errors) == {"sampling": 1}
    finally:
        decode.shutdown()
        prefill.shutdown()
