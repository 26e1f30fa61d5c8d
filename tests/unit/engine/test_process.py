"""EngineProcess: an engine loop in a child process, driven over a socket pair. The
reference is the same engine config stepped in this process (``Engine.generate``)."""

from __future__ import annotations

import threading

import pytest

from splitserve.engine.engine import Engine
from splitserve.engine.facts import EngineFacts
from splitserve.engine.process import EngineProcess
from splitserve.wire.config import EngineConfig
from splitserve.wire.engine_commands import AddRequest, Snapshot
from splitserve.wire.errors import EngineStopped, InvalidRequest
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, random_prompts

DEADLINE_S = 120


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    d = tmp_path_factory.mktemp("tiny")
    make_hf_checkpoint("llama", d)
    return EngineConfig(model=str(d), dtype="float32", num_kv_blocks=64)


def test_commands_and_token_ids_cross_to_the_engine_process_and_back(config):
    prompts = random_prompts([9, 17], 512)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    library = Engine(config)
    expected = [o.token_ids for o in library.generate(prompts, params)]
    outputs, errors, done = [], [], threading.Event()
    proc: EngineProcess

    def on_outputs(outs):  # the reader thread; the loop is paced: each hand-over taken
        outputs.extend(outs)
        proc.taken()
        if sum(o.finished for o in outputs) == len(prompts):
            done.set()

    proc = EngineProcess("w", config, on_outputs, errors.append, torch_threads=1)
    facts = proc.build()
    want = EngineFacts.of(library)
    assert (facts.revision, facts.kv_bytes_per_token) == (want.revision, want.kv_bytes_per_token)
    assert "on 1 torch threads" in facts.summary  # sized there as asked
    proc.start()
    try:
        for i, prompt in enumerate(prompts):
            proc.submit(AddRequest(f"r{i}", prompt, params)).result(DEADLINE_S)
        assert done.wait(DEADLINE_S)
        got = [[t for o in outputs if o.request_id == f"r{i}" for t in o.new_token_ids] for i in range(2)]
        assert got == expected
        with pytest.raises(InvalidRequest, match="empty"):  # its error, raised here
            proc.submit(AddRequest("bad", [], params)).result(DEADLINE_S)
        stats, _, _ = proc.submit(Snapshot()).result(DEADLINE_S)
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
        times = proc.thread_times()
        assert times.on_cpu_s > 0 and times.wall_s >= times.on_cpu_s
    finally:
        proc.stop()
    assert proc._proc.returncode == 0 and errors == []  # it exited by itself, on "stop"
    with pytest.raises(EngineStopped):  # at once
        proc.submit(Snapshot()).result(0)


def test_a_build_that_fails_there_raises_its_error_here(tmp_path):
    missing = str(tmp_path / "no-such-model")
    proc = EngineProcess("w", EngineConfig(model=missing), lambda outs: None, lambda e: None)
    with pytest.raises(Exception, match="no-such-model"):
        proc.build()
    assert proc._proc.returncode is not None  # the engine process is gone
    with pytest.raises(EngineStopped):
        proc.submit(Snapshot()).result(0)
