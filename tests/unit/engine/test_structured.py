"""Structured output on the real SmolLM2 (its tokenizer is what the grammar works
over): JSON schemas of every kind, regex and choice, batched with an unconstrained
row; every output validates with ``jsonschema``; a request resumed from any point
of its output (what a handoff and a failover do) continues exactly as the
undisturbed run; bad specs are refused with llguidance's words."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import FinishReason, SamplingParams, StructuredOutput

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {"first": NAME, "last": NAME},
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["person", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date"}, "score": {"type": "number"}},
        "required": ["when", "score"],
        "additionalProperties": False,
    },
]
QUESTION = "Describe a person, a city or a color as JSON."


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(EngineConfig(model="smollm2", dtype="float32", block_size=16, max_num_batched_tokens=256))


def _run(engine: Engine, params: list[SamplingParams], resumed: list[list[int]] | None = None) -> list:
    ids, texts = [], {}
    for i, p in enumerate(params):
        done = resumed[i] if resumed else None
        messages = [{"role": "user", "content": QUESTION}]
        ids.append(engine.add_request(messages=messages, params=p, output_token_ids=done))
        texts[ids[-1]] = engine.tokenizer.decode(done) if done else ""  # what the client had
    states, last = {i: engine.requests[i] for i in ids}, {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.text
            last[out.request_id] = out
    return [states[i].completion(texts[i], last.get(i)) for i in ids]


def _json(schema) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured=StructuredOutput("json_schema", json.dumps(schema)))


@pytest.mark.slow
def test_every_output_validates_against_its_schema_in_a_mixed_batch(engine):
    params = [_json(s) for s in SCHEMAS] + [SamplingParams(max_tokens=20)]
    outs = _run(engine, params)
    for schema, out in zip(SCHEMAS, outs):
        assert out.finish_reason == FinishReason.STOP, out.text  # complete, not cut off
        jsonschema.validate(json.loads(out.text), schema, format_checker=jsonschema.FormatChecker())
    assert not outs[-1].text.startswith(("{", "["))  # the unconstrained row answers in prose


@pytest.mark.slow
def test_regex_and_choice(engine):
    regex = SamplingParams(max_tokens=30, structured=StructuredOutput("regex", r"[A-Z][a-z]{2,8}, [0-9]{4}"))
    choice = SamplingParams(max_tokens=10, structured=StructuredOutput("choice", '["yes", "no", "maybe"]'))
    seeded = SamplingParams(
        max_tokens=10, temperature=1.0, seed=5, structured=StructuredOutput("choice", '["yes", "no"]')
    )
    out_regex, out_choice, out_seeded = _run(engine, [regex, choice, seeded])
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{4}", out_regex.text), out_regex.text
    assert out_choice.text in ("yes", "no", "maybe") and out_seeded.text in ("yes", "no")


@pytest.mark.slow
def test_a_request_resumed_anywhere_continues_as_the_undisturbed_run(engine):
    """What a handoff (the first token from a prefill worker) and a failover (the tokens
    a client already has) give the engine: the grammar is rebuilt from those tokens."""
    params = [_json(SCHEMAS[5]), _json(SCHEMAS[1])]
    whole = _run(engine, params)
    for cut in (1, 5, 11):
        resumed = _run(engine, params, [w.token_ids[:cut] for w in whole])
        # (a resumed request's output counts the tokens it was given)
        assert [r.token_ids for r in resumed] == [w.token_ids for w in whole]
        assert [r.text for r in resumed] == [w.text for w in whole]


@pytest.mark.slow
def test_bad_specs_and_tokens_are_refused(engine):
    for spec, needle in (
        (StructuredOutput("json_schema", '{"type": "bogus"}'), "bogus"),
        (StructuredOutput("regex", "("), "regex"),
        (StructuredOutput("json_schema", "{not json"), "json_schema"),
    ):
        with pytest.raises(InvalidRequest, match=needle):
            engine.add_request([1, 2, 3], SamplingParams(structured=spec))
    with pytest.raises(InvalidRequest, match="breaks the structured output"):  # a resume the grammar refuses
        engine.add_request([1, 2], _json(SCHEMAS[0]), output_token_ids=engine.tokenizer.encode("hello"))
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
    with pytest.raises(InvalidRequest, match="kind"):
        StructuredOutput("yaml", "x")


@pytest.mark.slow
def test_the_argmax_check_agrees_with_the_full_mask(engine):
    """The sampler keeps a guided greedy row's argmax when ``allows`` says the grammar
    takes it; that must be what the unpacked mask says of every token."""
    import torch

    from splitserve.engine.structured_masks import allowed_tokens, allows

    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[3]))
    grammars = [engine.tokenizer.grammar(spec, engine.tokenizer.encode(p)) for p in ("", '{"color": "', "{")]
    mask = allowed_tokens(grammars, engine.validator.vocab_size, torch.device("cpu"))
    assert [row.sum().item() > 0 for row in mask] == [True, True, True]
    for token in range(0, engine.validator.vocab_size, 97):
        got = allows(grammars, torch.tensor([token] * len(grammars)))
        assert got == [bool(mask[g, token]) for g in range(len(grammars))], token
