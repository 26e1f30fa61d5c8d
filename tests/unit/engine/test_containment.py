"""A request can only fail itself, in the real SmolLM2 engine: the request that
stopped a decode worker (``temperature: 1e308`` with a JSON format) is refused
with a sentence; a hot temperature under a grammar still gives valid JSON;
constraints that leave no token end their request alone; and a sequence whose
grammar, sampling, detokeniser or model step raises mid-batch ends alone with a
``SequenceFailed`` while the others' tokens equal an undisturbed run and the
engine goes on serving. Faults are injected with ``tests.faults``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from splitserve.engine.containment import MAX_BLAMED_STEPS
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import InvalidRequest, SequenceFailed, Unsampleable
from splitserve.wire.sampling import FinishReason, SamplingParams, StructuredOutput
from tests import faults

pytestmark = [pytest.mark.slow, pytest.mark.needs_smollm2]

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Count to five.", "Say hello."]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
ENUM = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="smollm2", dtype="float32", max_num_batched_tokens=512))


def _prompt(engine: Engine, i: int) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i]}])


def _add(engine: Engine, params: list[SamplingParams]) -> list[str]:
    return [engine.add_request(_prompt(engine, i), p) for i, p in enumerate(params)]


def _drain(engine: Engine, ids: list[str]) -> dict:
    states = {i: engine.requests[i] for i in ids}
    texts, last = dict.fromkeys(ids, ""), {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.text
            last[out.request_id] = out
    assert not engine.requests, "a request was left in the engine"
    return {i: states[i].completion(texts[i], last.get(i)) for i in ids}


@pytest.fixture(scope="module")
def undisturbed(engine):
    """Each question's greedy tokens (and with a JSON grammar), alone and undisturbed."""
    json_params = SamplingParams(max_tokens=24, structured=StructuredOutput("json_schema", json.dumps(ENUM)))
    plain = [engine.generate([_prompt(engine, i)], GREEDY)[0].token_ids for i in range(len(QUESTIONS))]
    guided = [engine.generate([_prompt(engine, i)], json_params)[0].token_ids for i in range(len(QUESTIONS))]
    return {"plain": plain, "json": guided, "json_params": json_params}


def test_the_reported_request_is_refused_with_a_sentence(engine):
    json_object = StructuredOutput("json_schema", '{"type": "object"}')
    with pytest.raises(InvalidRequest, match=r"temperature must be in \[0, 100\]"):
        engine.add_request("hi", SamplingParams(max_tokens=8, temperature=1e308, structured=json_object))
    assert not engine.requests


@pytest.mark.parametrize("temperature", [100.0, 1e-300])
def test_an_extreme_temperature_under_a_grammar_gives_valid_json(engine, temperature):
    """The grammar's mask comes after the temperature: even a flat distribution (or
    one a tiny temperature would overflow) samples only what the grammar allows."""
    spec = StructuredOutput("json_schema", json.dumps(ENUM))
    hot = SamplingParams(max_tokens=40, temperature=temperature, structured=spec)
    params = [dataclasses.replace(hot, seed=i) for i in range(3)]
    done = _drain(engine, _add(engine, params))
    for c in done.values():
        assert c.error is None and c.finish_reason == FinishReason.STOP
        assert json.loads(c.text)["answer"] in ("yes", "no", "maybe")


def test_constraints_that_leave_no_token_end_only_their_request(engine, undisturbed):
    digits = StructuredOutput("regex", "[0-9]+")
    letter = engine.tokenizer.encode("a")[0]
    bad = SamplingParams(max_tokens=8, structured=digits, allowed_token_ids=[letter])
    ids = _add(engine, [GREEDY, bad, GREEDY])
    done = _drain(engine, ids)
    failed = done[ids[1]]
    assert isinstance(failed.error, Unsampleable) and failed.finish_reason is None
    assert "exclude every token" in str(failed.error) and failed.token_ids == []
    assert done[ids[0]].token_ids == undisturbed["plain"][0]
    assert done[ids[2]].token_ids == undisturbed["plain"][2]
    assert engine.sequence_errors["unsampleable"] >= 1


@pytest.mark.parametrize("part", ["grammar", "sampling", "detokenization"])
def test_a_sequence_whose_part_raises_mid_batch_ends_alone(engine, undisturbed, part):
    at = 4
    target = undisturbed["json_params"] if part == "grammar" else GREEDY
    before = engine.sequence_errors[part]
    ids = _add(engine, [GREEDY, target, GREEDY, GREEDY])
    if part == "grammar":
        faults.fail_grammar(engine, ids[1], at)
    elif part == "detokenization":
        faults.fail_detokenizer(engine, ids[1], at)
    else:
        faults.fail_sampling(engine, _prompt(engine, 1), at)
    try:
        done = _drain(engine, ids)
    finally:
        engine.runner.sampler.__dict__.pop("_sample_batch", None)
    failed = done[ids[1]]
    assert isinstance(failed.error, SequenceFailed) and failed.error.kind == part
    assert failed.finish_reason is None
    whole = undisturbed["json" if part == "grammar" else "plain"][1]
    # the tokens it had stand (a grammar or detokeniser fault comes as the at-th is appended)
    assert failed.token_ids == whole[: len(failed.token_ids)] and at - 1 <= len(failed.token_ids) <= at
    for i in (0, 2, 3):
        assert done[ids[i]].error is None and done[ids[i]].token_ids == undisturbed["plain"][i]
    assert engine.sequence_errors[part] == before + 1
    # the engine serves on
    assert engine.generate([_prompt(engine, 1)], GREEDY)[0].token_ids == undisturbed["plain"][1]


def test_a_model_step_that_fails_once_is_run_again_and_nobody_fails(engine, undisturbed):
    retried = engine.containment.retried
    ids = _add(engine, [GREEDY, GREEDY, GREEDY])
    raised = faults.fail_forward(engine, ids[1], times=1)
    try:
        done = _drain(engine, ids)
    finally:
        del engine.runner.execute
    assert len(raised) == 1 and engine.containment.retried == retried + 1
    assert [done[i].token_ids for i in ids] == undisturbed["plain"][:3]


def test_a_model_step_that_keeps_failing_for_one_sequence_fails_only_it(engine, undisturbed):
    ids = _add(engine, [GREEDY, GREEDY, GREEDY])
    faults.fail_forward(engine, ids[1])
    try:
        done = _drain(engine, ids)
    finally:
        del engine.runner.execute
    failed = done[ids[1]]
    assert isinstance(failed.error, SequenceFailed) and failed.error.kind == "forward"
    assert done[ids[0]].token_ids == undisturbed["plain"][0]
    assert done[ids[2]].token_ids == undisturbed["plain"][2]
    assert engine.generate([_prompt(engine, 1)], GREEDY)[0].token_ids == undisturbed["plain"][1]


def test_a_model_that_fails_for_everyone_stops_the_engine(engine):
    """No sequence to blame: the step raises (the worker stops and its router resumes
    its requests elsewhere), after at most MAX_BLAMED_STEPS requests failed alone."""
    runner = engine.runner
    execute = runner.execute

    def broken(scheduled, on_layer=None):
        raise faults.Injected("the device is gone")

    runner.execute = broken
    try:
        alone = []
        with pytest.raises(faults.Injected):  # one at a time: blamed until it is clearly the engine
            for _ in range(MAX_BLAMED_STEPS):
                rid = engine.add_request(_prompt(engine, 0), GREEDY)
                out = engine.step()
                alone.append(out[0].error)
        assert len(alone) == MAX_BLAMED_STEPS - 1 and all(e.kind == "forward" for e in alone)
        engine.abort(rid)
        ids = _add(engine, [GREEDY, GREEDY])  # several, every one failing alone: at once
        with pytest.raises(faults.Injected):
            engine.step()
        for rid in ids:
            engine.abort(rid)
    finally:
        runner.execute = execute
    assert engine.generate([_prompt(engine, 0)], GREEDY)[0].token_ids  # a working model: served again
