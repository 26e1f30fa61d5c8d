"""EngineLoop: calls run on the loop thread between steps; outputs are routed."""

import gc
import threading
import time

import pytest

from splitserve.engine import loop as loop_module
from splitserve.engine.engine import Engine
from splitserve.engine.loop import EngineLoop
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import EngineStopped, GroupBroken, InvalidRequest
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, random_prompts
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_hf_checkpoint("llama", d)
    return Engine(EngineConfig(model=str(d), dtype="float32", num_kv_blocks=64))


def test_calls_run_on_the_loop_thread_and_outputs_arrive(engine):
    outputs, ticks, done = [], [], threading.Event()

    def on_outputs(outs):
        outputs.extend(outs)
        if any(o.finished for o in outs):
            done.set()

    prompt = random_prompts([9], 512)[0]
    expected = engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    loop = EngineLoop(engine, on_outputs, on_tick=lambda: ticks.append(threading.current_thread())).start()
    try:
        thread = loop.call(lambda e: threading.current_thread()).result(5)
        assert thread is not threading.current_thread() and thread.name == "engine-loop"
        rid = loop.call(
            lambda e: e.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        ).result(5)
        assert done.wait(10)
        tokens = [t for o in outputs if o.request_id == rid for t in o.new_token_ids]
        assert tokens == expected
        assert ticks and all(t is thread for t in ticks[:5])  # the tick runs even when idle
        with pytest.raises(InvalidRequest, match="empty"):  # errors reach the caller
            loop.call(lambda e: e.add_request([], SamplingParams())).result(5)
    finally:
        loop.stop()
    with pytest.raises(EngineStopped, match="stopped"):
        loop.call(lambda e: None).result(1)


def test_a_failing_callback_stops_the_loop_loudly(engine):
    def boom(outs):
        raise ZeroDivisionError("bug")

    errors = []
    loop = EngineLoop(engine, boom, on_error=errors.append).start()
    rid = loop.call(lambda e: e.add_request([1, 2, 3], SamplingParams(max_tokens=3))).result(5)
    loop._thread.join(10)
    assert isinstance(loop.error, ZeroDivisionError)
    assert errors == [loop.error]  # the worker hears of it (and fails its waiting requests)
    with pytest.raises(EngineStopped, match="stopped"):
        loop.call(lambda e: None).result(1)
    engine.abort(rid)
    loop.stop()  # as its worker would: the heap it froze is let go


def test_a_started_loop_keeps_the_heap_out_of_the_collectors_walk_until_it_stops(engine):
    others = loop_module._heap_freezes  # loops of this process still running
    loop = EngineLoop(engine, lambda outs: None).start()
    try:
        engine_objects = len(gc.get_referents(engine.model)) + 1
        assert gc.get_freeze_count() >= engine_objects  # frozen: a full collection skips them
        assert engine.model not in gc.get_objects()
    finally:
        loop.stop()
    if others == 0:
        assert gc.get_freeze_count() == 0 and loop_module._heap_freezes == 0
        assert any(o is engine.model for o in gc.get_objects())  # collected as ever again


def test_a_call_that_finds_the_engine_stopped_stops_the_loop(engine):
    """A call raising ``EngineStopped`` (a broken TP group, seen while adding a request)
    reaches its caller and stops the loop, so the worker reports itself lost instead
    of answering stats while it can compute nothing."""

    def broken(e):
        raise GroupBroken("tensor-parallel rank 0 has lost its group: connection closed")

    errors = []
    loop = EngineLoop(engine, lambda outs: None, on_error=errors.append).start()
    with pytest.raises(GroupBroken):
        loop.call(broken).result(5)
    loop._thread.join(10)
    assert isinstance(loop.error, GroupBroken) and errors == [loop.error]
    with pytest.raises(EngineStopped, match="stopped"):
        loop.call(lambda e: None).result(1)


def test_a_build_function_runs_on_the_loop_thread_before_any_step(engine):
    """Workers hand the loop a function that builds their engine: it runs on the thread
    that will step the engine (engine/loop.py says why), ``build`` returns its engine,
    and no call runs until ``start``."""
    built_on, started = [], []

    def build():
        built_on.append(threading.current_thread())
        return engine

    loop = EngineLoop(build, lambda outs: None, name="built-here")
    assert loop.build() is engine
    assert built_on[0].name == "built-here" and built_on[0] is not threading.current_thread()
    # queued now; run only after start (it sees whether start was called)
    pending = loop.call(lambda e: (bool(started), threading.current_thread()))
    started.append(True)
    loop.start()
    try:
        assert pending.result(10) == (True, built_on[0])
    finally:
        loop.stop()


def test_a_failing_build_raises_from_build_and_start():
    def build():
        raise InvalidRequest("no such model")

    loop = EngineLoop(build, lambda outs: None)
    with pytest.raises(InvalidRequest, match="no such model"):
        loop.build()
    with pytest.raises(InvalidRequest, match="no such model"):
        loop.start()
    with pytest.raises(EngineStopped):
        loop.call(lambda e: None).result(1)


def test_a_paced_loop_steps_at_most_once_past_the_outputs_not_taken(engine):
    """A paced loop's consumer makes text on its own thread (``engine.text``): the loop
    runs one step while the previous hand-over is being taken, never two, so what the
    consumer asks on taking it (an abort at a stop string) runs within one step."""
    handed, ticks = [], [0]

    def tick():
        ticks[0] += 1

    loop = EngineLoop(engine, handed.append, on_tick=tick, paced=True).start()
    try:
        rid = loop.call(lambda e: e.add_request([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True)))
        rid = rid.result(5)
        wait_until(lambda: len(handed) == 2, "two steps handed over", 30)
        seen = ticks[0]
        wait_until(
            lambda: ticks[0] >= seen + 20, "the loop went round 20 times", 30
        )  # waiting for the consumer
        assert len(handed) == 2
        aborted = loop.call(lambda e: e.abort(rid))  # asked while taking the first: runs before a third step
        loop.taken()
        assert aborted.result(10) is True
        loop.taken()
        wait_until(lambda: not loop.call(lambda e: e.has_unfinished()).result(5), "the engine finished", 30)
        assert len(handed) == 2 and sum(len(o.new_token_ids) for outs in handed for o in outs) == 2
    finally:
        loop.stop()


def test_the_loop_says_where_its_threads_time_went(engine):
    """``thread_times``: a loop with no work counts its time idle; a paced loop whose
    consumer takes nothing counts its time waiting for it; the kernel's on-CPU time is
    read for the loop's own thread; the parts never add up to more than the wall time,
    even with a tick that runs 2 ms on the CPU between the waits' sleeps (a wait counts
    only its sleep)."""

    def tick() -> None:  # what a NIXL source's progress costs, say
        until = time.thread_time() + 0.002
        while time.thread_time() < until:
            pass

    loop = EngineLoop(engine, lambda outs: None, on_tick=tick, paced=True).start()
    try:
        start = loop.thread_times()
        wait_until(lambda: loop.thread_times().minus(start).idle_s > 0.2, "0.2 s counted idle", 30)
        idle = loop.thread_times().minus(start)
        assert idle.paced_s == 0 and idle.on_cpu_s + idle.runnable_s + idle.idle_s <= idle.wall_s * 1.05
        loop.call(lambda e: e.add_request([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True)))
        before = loop.thread_times()
        wait_until(lambda: loop.thread_times().minus(before).paced_s > 0.2, "0.2 s counted paced", 30)
        waiting = loop.thread_times().minus(before)
        assert waiting.on_cpu_s > 0  # the steps ran on this thread (Linux)
        parts = waiting.on_cpu_s + waiting.runnable_s + waiting.paced_s + waiting.idle_s
        assert parts <= waiting.wall_s * 1.05 and "waiting for the outputs to be taken" in waiting.describe()
    finally:
        loop.stop()
