"""Decode admission under block pressure, against a real engine's block manager:
prefilled requests get KV blocks in the order they arrived (a small request
does not overtake a large one queued before it), a full queue refuses at once,
and a request whose deadline or lease comes first leaves with a clear error."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.decode_worker.admission import AdmissionQueue
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import DeadlineExceeded, LeaseExpired, LoRASlotsBusy, Overloaded
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, random_prompts

PARAMS = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-admission")
    make_hf_checkpoint("llama", d)
    cfg = EngineConfig(
        model=str(d), dtype="float32", block_size=16, num_kv_blocks=8, enable_prefix_caching=False
    )
    return Engine(cfg)


def _allocator(engine: Engine, rid: str, prompt: list[int]):
    async def allocate():
        try:
            return engine.import_request(rid, prompt, [1], PARAMS)
        except Overloaded:
            return None

    return allocate


async def _settle() -> None:
    """Let the queue's runner take every step it can without new blocks (no wall clock)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_requests_get_blocks_in_arrival_order(engine):
    blocker, big, small, tiny = random_prompts([96, 64, 10, 10], 512, seed=3)

    async def run():
        queue = AdmissionQueue("d0", max_waiting=8)
        engine.import_request("blocker", blocker, [1], PARAMS)  # 6 of 8 blocks: 2 left
        order: list[str] = []
        waits = {}
        for rid, prompt in (("big", big), ("small", small), ("tiny", tiny)):
            fut = asyncio.ensure_future(queue.admit(rid, _allocator(engine, rid, prompt), None, 60.0))
            fut.add_done_callback(lambda f, rid=rid: order.append(rid))
            waits[rid] = fut
        await _settle()
        # "small" (1 block) would fit in the 2 free blocks, but "big" (4) is ahead of it.
        assert order == [] and len(queue) == 3
        engine.abort("blocker")
        queue.wake()
        await asyncio.gather(*waits.values())
        assert order == ["big", "small", "tiny"]
        for rid in order:
            engine.abort(rid)

    asyncio.run(run())


def test_a_full_queue_and_an_expired_wait_are_refused_clearly(engine):
    blocker, a, b = random_prompts([120, 40, 40], 512, seed=4)

    async def run():
        queue = AdmissionQueue("d0", max_waiting=1)
        engine.import_request("blocker", blocker, [1], PARAMS)  # 8 of 8 blocks
        waiting = asyncio.ensure_future(queue.admit("a", _allocator(engine, "a", a), None, 60.0))
        await _settle()
        with pytest.raises(Overloaded, match="1 requests waiting for KV blocks"):
            await queue.admit("b", _allocator(engine, "b", b), None, 60.0)
        waiting.cancel()
        await _settle()
        assert len(queue) == 0  # a cancelled waiter leaves the queue
        # The lease (1.2 s, less the 1 s margin a pull needs) ends before blocks come back.
        with pytest.raises(Overloaded, match="before its KV lease ran out"):
            await queue.admit("b", _allocator(engine, "b", b), None, 1.2)
        with pytest.raises(DeadlineExceeded, match="before its deadline"):
            await queue.admit("b", _allocator(engine, "b", b), time.monotonic() + 0.05, 60.0)
        engine.abort("blocker")
        # A lease all but over on arrival is a failed transfer, whatever room there is.
        with pytest.raises(LeaseExpired, match="ended before decode worker d0 got it"):
            await queue.admit("b", _allocator(engine, "b", b), None, 0.5)
        assert "b" not in engine.requests

    asyncio.run(run())


def _lora_allocator(engine: Engine, rid: str, prompt: list[int], params: SamplingParams):
    """As ``side.WorkerSide.admit``'s: a wait for a LoRA slot is the queue's to see."""

    async def allocate():
        try:
            return engine.import_request(rid, prompt, [1], params)
        except LoRASlotsBusy:
            raise
        except Overloaded:
            return None

    return allocate


def test_a_request_waiting_for_a_lora_slot_lets_the_others_go_first(tmp_path):
    """One LoRA slot, held by a request under a1: a request under a2 waits for it, and
    a base request behind it takes its blocks meanwhile; once the slot is free, a2's
    request gets it."""
    pytest.importorskip("peft")
    from tests.lora_util import make_adapter

    checkpoint = tmp_path / "model"
    make_hf_checkpoint("llama", checkpoint)
    dirs = {}
    for i, name in enumerate(("a1", "a2")):
        dirs[name] = tmp_path / name
        make_adapter(checkpoint, dirs[name], 4, 8, ["q_proj", "v_proj"], False, seed=i)
    lora = {"enable_lora": True, "lora_modules": {n: str(d) for n, d in dirs.items()}, "max_loras": 1}
    engine = Engine(
        EngineConfig(model=str(checkpoint), dtype="float32", block_size=16, num_kv_blocks=16, **lora)
    )
    held, under_a2, base = random_prompts([20, 20, 20], 512, seed=5)

    async def run():
        queue = AdmissionQueue("d0", max_waiting=8)
        a1 = SamplingParams(max_tokens=4, adapter="a1")
        engine.import_request("held", held, [1], a1)  # slot 0 is a1's while it runs
        order: list[str] = []
        waits = {}
        for rid, prompt, adapter in (("a2", under_a2, "a2"), ("base", base, None)):
            params = SamplingParams(max_tokens=4, adapter=adapter)
            fut = asyncio.ensure_future(
                queue.admit(rid, _lora_allocator(engine, rid, prompt, params), None, 60.0)
            )
            fut.add_done_callback(lambda f, rid=rid: order.append(rid))
            waits[rid] = fut
        await _settle()
        assert order == ["base"] and len(queue) == 1  # the base went past the waiting a2
        engine.abort("held")
        queue.wake()
        await asyncio.gather(*waits.values())
        assert order == ["base", "a2"]
        assert engine.requests["a2"].seq.lora_slot == 0

    asyncio.run(run())
