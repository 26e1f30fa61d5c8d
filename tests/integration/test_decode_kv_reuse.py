"""A conversation's KV flows back from decode (issue 52): a turn's prompt and answer end
in its decode worker's cache, which the router indexes as it indexes prefill workers';
the prefill worker computing the next turn copies them from that decode worker
(``DecodeWorker.lend_prefix``, NIXL) instead of computing them again. In this process:
the router's dispatcher over a real prefill worker and a real decode worker (the tiny
model), no Ray. The next turn's tokens equal the monolithic engine's; its trace says
the prefix came from the decode worker, past what the prefill worker held itself
(the earlier answer); ``/metrics`` counts those tokens as copied from decode KV; and
no block stays held."""

from __future__ import annotations

import asyncio

from splitserve.decode_worker.in_process import InProcessDecodeClient
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.router.dispatch import Dispatcher
from splitserve.router.events import GenerateInput, TokenEvent
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policy import PolicySpec
from splitserve.router.registry import WorkerRegistry
from splitserve.router.roles import Role
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeWorkerSpec
from splitserve.wire.prefill import PrefillWorkerSpec
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.waiting import wait_until

PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)
DEADLINE_S = 300


def test_the_next_turn_copies_the_conversation_from_the_decode_worker(checkpoint):
    engine = EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=256, block_size=8)
    first, follow_up = random_prompts([50, 20], 512, seed=13)
    (answer,) = [c.token_ids for c in Engine(engine).generate([first], PARAMS)]
    second = first + answer + follow_up  # the next turn: the conversation so far, then the new message
    (want,) = [c.token_ids for c in Engine(engine).generate([second], PARAMS)]
    prefill = PrefillWorker(PrefillWorkerSpec("prefill-0", engine, "nixl", 30.0, torch_threads=1))
    decode = DecodeWorker(DecodeWorkerSpec("decode-0", engine, "nixl", 30.0, 8, torch_threads=1))

    async def conversation():
        registry = WorkerRegistry()
        registry.add("prefill-0", Role.PREFILL, prefill, engine.block_size)
        registry.add("decode-0", Role.DECODE, InProcessDecodeClient(decode), engine.block_size)
        for wid in ("prefill-0", "decode-0"):
            await registry.activate(wid)
        policy = PolicySpec(conditional_disaggregation=False)  # every turn goes to the prefill worker
        d = Dispatcher(registry, decode.engine.validator, "tiny", policy=policy)
        metrics = RouterMetrics("tiny", registry, list, lambda: 0, dict)
        d.sinks.append(metrics)

        async def turn(rid: str, prompt: list[int]) -> list[int]:
            tokens = []
            async for event in d.generate(GenerateInput(PARAMS, prompt=prompt, request_id=rid)):
                if isinstance(event, TokenEvent):
                    tokens += event.token_ids
            return tokens

        got_first = await turn("turn-1", first)
        await registry.poll()  # the router's poller: each cache as it is now
        d.decider.handover_s = 0.0  # the copy wins (the tiny model computes faster than a pull)
        got_second = await turn("turn-2", second)
        counted = metrics.decode_kv.labels("tiny", "copied")._value.get()
        return got_first, got_second, d.traces.latest(1)[0], counted

    try:
        got_first, got_second, trace, counted = asyncio.run(asyncio.wait_for(conversation(), DEADLINE_S))
        assert got_first == answer and got_second == want
        bs = engine.block_size
        # the prefill worker held the first prompt's blocks; the answer's came from the decode worker
        assert trace.prefix_pulled_from == "decode-0"
        assert (
            trace.prefix_pulled_tokens
            >= (len(first) + len(answer) - 1) // bs * bs - len(first) // bs * bs
            > 0
        )
        assert counted == trace.prefix_pulled_tokens

        def nothing_held() -> bool:
            stats = [asyncio.run(w.stats()) for w in (prefill, decode)]
            return all(s.engine.num_used_blocks == 0 and not getattr(s, "exports", ()) for s in stats)

        wait_until(nothing_held, "both workers free every block (loans confirmed, requests ended)")
    finally:
        decode.shutdown()
        prefill.shutdown()
