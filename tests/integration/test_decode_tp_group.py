"""A colocated worker as a TP group without Ray: the ``DecodeWorker`` (rank 0) in
this process and a ``DecodeRank`` in a spawned one. Requests run through the
worker's own API (``start`` and ``stream``) give the TP=1 engine's greedy
tokens, a request resumed with tokens already sent continues them exactly, and
the group outlives an idle period longer than its collective timeout (rank 0
sends heartbeats), and a sequence that fails on rank 0 ends alone while the
group goes on."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import time

from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.decode import DecodeTask, DecodeWorkerSpec
from splitserve.wire.errors import SequenceFailed
from splitserve.wire.sampling import SamplingParams
from splitserve.wire.tp import TPInit
from tests import faults
from tests.conftest import make_hf_checkpoint, random_prompts
from tests.integration.tp_ranks import decode_rank_main, free_port

TIMEOUT_S = 6.0  # the group's collective timeout: an unheard-from rank fails after it


async def _run(worker: DecodeWorker, tasks: list[DecodeTask]) -> dict[str, list[int]]:
    """Start ``tasks`` on one outbox and read it until each has ended; tokens by request."""
    tokens, errors = await _run_all(worker, tasks)
    assert not errors, errors
    return tokens


async def _run_all(worker: DecodeWorker, tasks: list[DecodeTask]) -> tuple[dict, dict]:
    """As ``_run``, but a request may end with an error: (tokens, errors) by request."""
    tokens: dict[str, list[int]] = {t.request_id: [] for t in tasks}
    errors = {}
    for task in tasks:
        await worker.start("test", task)
    left = set(tokens)
    stream = worker.stream("test")
    while left:
        for batch in await anext(stream):
            tokens[batch.request_id] += batch.token_ids
            if batch.error is not None:
                errors[batch.request_id] = batch.error
            if batch.finish_reason is not None or batch.error is not None:
                left.discard(batch.request_id)
    await stream.aclose()
    return tokens, errors


def _group(tmp_path, speculative=None) -> tuple[EngineConfig, DecodeWorkerSpec, mp.Process]:
    """A tiny model's TP=2 engine config, rank 0's worker spec, and rank 1 started."""
    make_hf_checkpoint("llama", tmp_path)
    engine = EngineConfig(
        model=str(tmp_path), dtype="float32", tp_size=2, num_kv_blocks=128, speculative=speculative
    )
    address = f"tcp://127.0.0.1:{free_port()}"
    spec = DecodeWorkerSpec("c", engine, None, 10.0, 8, torch_threads=1, tp=TPInit(0, 2, address, TIMEOUT_S))
    rank1 = mp.get_context("spawn").Process(
        target=decode_rank_main, args=(dataclasses.replace(spec, tp=TPInit(1, 2, address, TIMEOUT_S)),)
    )
    rank1.start()
    return engine, spec, rank1


def test_a_colocated_tp2_group_decodes_resumes_and_idles_like_tp1(tmp_path):
    engine, spec, rank1 = _group(tmp_path)
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


def test_a_tp2_group_fails_one_sequence_on_both_ranks_and_goes_on(tmp_path):
    """Rank 0's sampler raises for one request mid-batch: that request ends with its
    error, the others' tokens equal TP=1's, and the group (rank 1 following rank 0's
    steps, in which the failed sequence no longer appears) serves the next request."""
    engine, spec, rank1 = _group(tmp_path)
    reference = Engine(dataclasses.replace(engine, tp_size=1))
    prompts = random_prompts([5, 40, 90], 512, seed=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [c.token_ids for c in reference.generate(prompts, params)]
    worker = DecodeWorker(spec)
    try:
        faults.fail_sampling(worker.engine, prompts[1], at=5)
        tasks = [DecodeTask(f"r{i}", p, params) for i, p in enumerate(prompts)]
        got, errors = asyncio.run(_run_all(worker, tasks))
        assert isinstance(errors["r1"], SequenceFailed) and errors["r1"].kind == "sampling"
        assert got["r1"] == expected[1][:5]
        assert (got["r0"], got["r2"]) == (expected[0], expected[2]) and set(errors) == {"r1"}
        again, errors = asyncio.run(_run_all(worker, [DecodeTask("again", prompts[2], params)]))
        assert again["again"] == expected[2] and not errors
        assert rank1.is_alive() and worker.loop.error is None
    finally:
        worker.shutdown()
        rank1.join(30)
    assert rank1.exitcode == 0


def test_a_tp2_group_verifies_a_draft_models_proposals_like_tp1(tmp_path):
    """Speculation under tensor parallelism: the draft (here the target itself, whole
    on rank 0) proposes, both ranks run the verification chunks, and the tokens are
    TP=1's without speculation, a resumed request's too. Every proposal is kept (the
    draft is the target, in float32). The price rule would not run a draft as slow
    as its target: adaptive k is off, 3 tokens every step."""
    engine, spec, rank1 = _group(
        tmp_path, SpeculativeConfig("draft", num_tokens=3, draft_model=str(tmp_path), adaptive=False)
    )
    reference = Engine(dataclasses.replace(engine, tp_size=1, speculative=None))
    prompts = random_prompts([5, 40, 90], 512, seed=5)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = [c.token_ids for c in reference.generate(prompts, params)]
    worker = DecodeWorker(spec)
    try:
        tasks = [DecodeTask(f"r{i}", p, params) for i, p in enumerate(prompts)]
        assert [asyncio.run(_run(worker, tasks))[t.request_id] for t in tasks] == expected
        resumed = DecodeTask("again", prompts[2], params, output_token_ids=expected[2][:5])
        assert asyncio.run(_run(worker, [resumed]))["again"] == expected[2][5:]
        counters = worker.engine.stats().speculation
        assert counters.proposed_tokens > 16 and counters.accepted_tokens == counters.proposed_tokens, (
            counters
        )
    finally:
        worker.shutdown()
        rank1.join(30)
    assert rank1.exitcode == 0
