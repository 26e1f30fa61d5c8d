"""A worker makes text off its engine's step (``engine.text``): the step emits token ids,
the decode worker's output path detokenises on the actor's loop, and a stop string
found there ends the request in the engine within one step (the loop runs at most one
step past outputs whose text is not made yet). SmolLM2 behind a colocated decode worker
and behind a prefill worker, in this process; the reference is the library's
``Engine.generate`` (whose own text equals a whole decode: ``test_text``)."""

from __future__ import annotations

import asyncio
import threading

from splitserve.decode_worker.in_process import InProcessDecodeClient
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.engine.tokenizer import IncrementalDetokenizer
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeTask, DecodeWorkerSpec
from splitserve.wire.errors import SequenceFailed
from splitserve.wire.prefill import PrefillWorkerSpec
from splitserve.wire.sampling import FinishReason, SamplingParams
from tests.integration.in_process import blocks_held, generated, handing_over, run
from tests.waiting import wait_until

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]
DEADLINE_S = 300
CONFIG = EngineConfig(model="smollm2", dtype="float32", block_size=16, kv_cache_memory_mib=64)


def _chat(engine: Engine, q: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])


def _stop_inside(text: str) -> tuple[str, str]:
    """A stop string from the middle of ``text``, and the text a stop there leaves."""
    stop = text[len(text) // 2 : len(text) // 2 + 5]
    return stop, text[: text.index(stop)]


def test_a_decode_worker_makes_text_off_the_engine_thread_and_stops_within_a_step(smollm2, monkeypatch):
    library = Engine(CONFIG)
    prompts = [_chat(library, q) for q in QUESTIONS]
    plain = SamplingParams(max_tokens=40)
    want = library.generate(prompts, plain)
    stop, stopped_text = _stop_inside(want[0].text)
    stopping = SamplingParams(max_tokens=40, stop=(stop,))
    (want_stopped,) = library.generate([prompts[0]], stopping)
    assert want_stopped.text == stopped_text and want_stopped.finish_reason == FinishReason.STOP
    kept = len(want_stopped.token_ids)

    worker = DecodeWorker(DecodeWorkerSpec("decode-0", CONFIG, None, 30.0, 8, torch_threads=1))
    step, threads = IncrementalDetokenizer.step, set()

    def recording_step(self, token_ids):  # where each token's text is made
        threads.add(threading.current_thread().name)
        return step(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "step", recording_step)
    sampled = []  # the engine's tokens for the stopped request, step by step, before any text

    def on_outputs(outs, deliver=worker.loop._on_outputs):
        sampled.extend(len(o.new_token_ids) for o in outs if o.request_id == "stopped")
        deliver(outs)

    worker.loop._on_outputs = on_outputs
    client = InProcessDecodeClient(worker)

    async def serve():
        runs = [generated(client, f"plain-{i}", p, plain) for i, p in enumerate(prompts)]
        got = await asyncio.gather(*runs, generated(client, "stopped", prompts[0], stopping))
        await client.close()
        return got

    try:
        *got, got_stopped = asyncio.run(asyncio.wait_for(serve(), DEADLINE_S))
        for (tokens, text, reason), w in zip(got, want):
            assert (tokens, text, reason) == (w.token_ids, w.text, w.finish_reason)
        assert got_stopped == (want_stopped.token_ids, stopped_text, FinishReason.STOP)
        # text was made, never on the engine's thread
        assert threads and "decode-0-engine" not in threads
        # the engine sampled at most one step more for it than the client kept, then let it go
        wait_until(lambda: blocks_held(worker) == 0, "the worker freed every block", 60)
        assert kept <= sum(sampled) <= kept + 1
    finally:
        worker.shutdown()


def test_stop_strings_through_a_handoff_at_the_first_token_and_after_it(smollm2):
    """Disaggregated: the prefill worker makes its first token's text (a stop string there
    ends the request: no KV exported, its blocks back, as an EOS would); the decode worker
    makes the rest, the first token's text its stop strings' context."""
    library = Engine(CONFIG)
    prompt = _chat(library, QUESTIONS[1])
    (free,) = library.generate([prompt], SamplingParams(max_tokens=40))
    first = library.tokenizer.decode(free.token_ids[:1])
    at_first = first.strip()[:2]
    later, later_text = _stop_inside(free.text)
    cases = {  # request id: its params, and the library's (tokens, text, finish reason)
        rid: (params, library.generate([prompt], params)[0])
        for rid, params in (
            ("at-first", SamplingParams(max_tokens=40, stop=(at_first,))),
            ("later", SamplingParams(max_tokens=40, stop=(later,))),
            ("whole", SamplingParams(max_tokens=40)),
        )
    }
    assert cases["at-first"][1].token_ids == free.token_ids[:1]
    assert cases["later"][1].text == later_text and cases["whole"][1].text == free.text
    prefill = PrefillWorker(PrefillWorkerSpec("prefill-0", CONFIG, "nixl", 30.0, torch_threads=1))
    decode = DecodeWorker(DecodeWorkerSpec("decode-0", CONFIG, "nixl", 30.0, 8, torch_threads=1))

    async def serve():
        d = await handing_over(prefill, decode, "smollm2")
        got = {}
        for rid, (params, _) in cases.items():
            got[rid] = (*await run(d, rid, prompt, params), d.traces.latest(1)[0])
        return got

    try:
        got = asyncio.run(asyncio.wait_for(serve(), DEADLINE_S))
        for rid, (_, want) in cases.items():
            tokens, text, reason, trace = got[rid]
            assert (tokens, text, reason) == (want.token_ids, want.text, want.finish_reason), rid
            assert trace.prefill_worker == "prefill-0"
        assert got["at-first"][3].decode_worker == "" and got["later"][3].decode_worker == "decode-0"
        for worker in (prefill, decode):
            wait_until(lambda w=worker: blocks_held(w) == 0, "the worker freed every block", 60)
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_text_that_cannot_be_made_fails_its_request_alone(smollm2):
    """A request whose text the worker cannot make ends alone (``SequenceFailed``, kind
    ``detokenization``, counted in the worker's stats as the engine counts a request
    that failed alone), its blocks freed; the others' tokens and text are unchanged."""
    library = Engine(CONFIG)
    prompts = [_chat(library, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = library.generate(prompts, params)
    worker = DecodeWorker(DecodeWorkerSpec("decode-0", CONFIG, None, 30.0, 8, torch_threads=1))
    texts = worker.requests._texts
    feed = texts.feed

    def failing(out):
        if out.request_id == "broken" and out.num_output_tokens >= 4:
            raise RuntimeError("the tokenizer broke")
        return feed(out)

    texts.feed = failing
    client = InProcessDecodeClient(worker)

    async def one(rid: str, prompt: list[int]):
        tokens, text = [], ""
        try:
            async for batch in client.generate(DecodeTask(rid, prompt, params)):
                tokens, text = tokens + batch.token_ids, text + batch.text
        except SequenceFailed as e:
            return tokens, text, e
        return tokens, text, None

    async def serve():
        got = await asyncio.gather(
            *(one(f"r{i}", p) for i, p in enumerate(prompts)), one("broken", prompts[1])
        )
        stats = await worker.stats()
        await client.close()
        return got, stats

    try:
        (*got, broken), stats = asyncio.run(asyncio.wait_for(serve(), DEADLINE_S))
        assert [g[:2] for g in got] == [(w.token_ids, w.text) for w in want] and all(
            g[2] is None for g in got
        )
        tokens, _, error = broken
        assert isinstance(error, SequenceFailed) and error.kind == "detokenization"
        assert "the tokenizer broke" in str(error) and tokens == want[1].token_ids[: len(tokens)]
        assert dict(stats.engine.sequence_errors) == {"detokenization": 1}
        wait_until(lambda: blocks_held(worker) == 0, "the worker freed every block", 60)
    finally:
        worker.shutdown()
