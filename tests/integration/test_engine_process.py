"""A colocated decode worker whose engine runs in a process of its own
(``engine.process``), SmolLM2 behind it in this process. The reference is the
library's ``Engine.generate`` in this process: the same tokens and text, and a stop
string that ends its request. The steps run in the other process: this process holds
no engine thread, and the engine process's loop thread reports the time it stepped.
Bad input is refused there and loses nothing. Neither process outlives the other
silently: a lost engine process ends every request with ``WorkerLost`` and fails the
next start and poll at once; a worker killed with SIGKILL takes its engine with it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import pytest

from splitserve.decode_worker.in_process import InProcessDecodeClient
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeTask, DecodeWorkerSpec
from splitserve.wire.errors import EngineStopped, InvalidRequest, WorkerLost
from splitserve.wire.sampling import FinishReason, SamplingParams
from tests.integration.cluster_util import process_exited, wait_until
from tests.integration.in_process import generated

DEADLINE_S = 300
CONFIG = EngineConfig(model="smollm2", dtype="float32", block_size=16, kv_cache_memory_mib=64)
SPEC = DecodeWorkerSpec("decode-0", CONFIG, None, 30.0, 8, torch_threads=1, engine_process=True)
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def library(smollm2) -> Engine:
    return Engine(CONFIG)


@pytest.fixture
def worker(smollm2):
    w = DecodeWorker(SPEC)
    yield w
    w.shutdown()


def _chat(engine: Engine, q: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])


def _free_blocks(worker: DecodeWorker) -> int:
    async def ask():
        return (await worker.stats()).engine.num_free_blocks

    return asyncio.run(ask())


def test_tokens_and_text_equal_the_library_engine_s_from_the_other_process(library, worker):
    prompts = [_chat(library, q) for q in QUESTIONS]
    plain = SamplingParams(max_tokens=40)
    want = library.generate(prompts, plain)
    stop = want[0].text[len(want[0].text) // 2 :][:5]
    stopping = SamplingParams(max_tokens=40, stop=(stop,))
    (want_stopped,) = library.generate([prompts[0]], stopping)
    assert want_stopped.finish_reason == FinishReason.STOP and len(want_stopped.token_ids) < 40
    free = _free_blocks(worker)
    client = InProcessDecodeClient(worker)

    async def serve():
        runs = [generated(client, f"plain-{i}", p, plain) for i, p in enumerate(prompts)]
        got = await asyncio.gather(*runs, generated(client, "stopped", prompts[0], stopping))
        await client.close()
        return got, await worker.engine_thread()

    (*got, got_stopped), times = asyncio.run(asyncio.wait_for(serve(), DEADLINE_S))
    for (tokens, text, reason), w in zip(got, want):
        assert (tokens, text, reason) == (w.token_ids, w.text, w.finish_reason)
    assert got_stopped == (want_stopped.token_ids, want_stopped.text, FinishReason.STOP)
    # the steps ran in the engine's process: none of this one's threads is its loop, whose
    # own thread (read there) spent CPU time stepping
    assert worker.engine is None and worker.loop.pid not in (None, os.getpid())
    assert not any(t.name == "decode-0-engine" for t in threading.enumerate())
    assert times.on_cpu_s > 0 and times.wall_s > times.on_cpu_s
    wait_until(lambda: _free_blocks(worker) == free, "the engine did not free its blocks", DEADLINE_S)


def test_bad_input_is_refused_there_and_the_worker_serves_on(library, worker):
    prompt = _chat(library, QUESTIONS[1])
    (want,) = library.generate([prompt], SamplingParams(max_tokens=12))
    client = InProcessDecodeClient(worker)
    too_long = list(range(100, 100 + library.max_model_len + 1))

    async def serve():
        with pytest.raises(InvalidRequest, match="tokens"):
            await generated(client, "too-long", too_long, SamplingParams(max_tokens=4))
        got = await generated(client, "good", prompt, SamplingParams(max_tokens=12))
        await client.close()
        return got

    assert asyncio.run(asyncio.wait_for(serve(), DEADLINE_S)) == (
        want.token_ids,
        want.text,
        want.finish_reason,
    )


def test_a_lost_engine_process_ends_its_requests_and_fails_what_comes_after_at_once(library, worker):
    prompt = _chat(library, QUESTIONS[2])
    client = InProcessDecodeClient(worker)
    long = SamplingParams(max_tokens=1000, ignore_eos=True)

    async def serve():
        seen = []

        async def read():
            async for batch in client.generate(DecodeTask("long", prompt, long)):
                seen.extend(batch.token_ids)

        reading = asyncio.ensure_future(read())
        while len(seen) < 3:  # running there
            assert not reading.done()
            await asyncio.sleep(0.01)
        os.kill(worker.loop.pid, signal.SIGKILL)
        with pytest.raises(WorkerLost, match="decode-0"):
            await reading
        with pytest.raises(EngineStopped):  # a start after it: refused, nothing held
            await generated(client, "after", prompt, SamplingParams(max_tokens=4))
        with pytest.raises(EngineStopped):  # the poll that has the pool replace the worker
            await worker.stats()
        await client.close()
        return len(seen)

    assert asyncio.run(asyncio.wait_for(serve(), DEADLINE_S)) < 1000
    assert isinstance(worker.loop.error, EngineStopped)


def test_a_worker_killed_with_sigkill_takes_its_engine_process_with_it(smollm2):
    script = (
        "import time\n"
        "from splitserve.decode_worker.worker import DecodeWorker\n"
        "from splitserve.wire.config import EngineConfig\n"
        "from splitserve.wire.decode import DecodeWorkerSpec\n"
        f"w = DecodeWorker({SPEC!r})\n"
        "print(w.loop.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(holder.stdout.readline())
        assert not process_exited(engine_pid)
        holder.kill()
        holder.wait(DEADLINE_S)
        wait_until(lambda: process_exited(engine_pid), "the engine process outlived its worker", DEADLINE_S)
    finally:
        holder.kill()
