"""N-gram speculation on the real SmolLM2-135M-Instruct (float32), copying text it
was given: greedy tokens equal transformers' ``generate``, most drafts are kept;
a JSON answer under a schema equals the engine's own without speculation and
validates (the grammar cuts a draft where it would refuse a token)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.sampling import FinishReason, SamplingParams, StructuredOutput
from tests.conftest import hf_greedy

TEXT = (
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to fund the reading room, the children's section and "
    "a small cafe, and to postpone the rooftop garden until next year."
)
RECORD = {"name": "Ada Lovelace", "born": 1815, "city": "London", "fields": ["mathematics", "computing"]}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "city": {"type": "string"},
        "fields": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "born", "city", "fields"],
    "additionalProperties": False,
}
BASE = dict(model="smollm2", dtype="float32", block_size=16, max_num_batched_tokens=256)
NGRAM = SpeculativeConfig(method="ngram", num_tokens=4)


@pytest.fixture(scope="module")
def engines(smollm2):
    return Engine(EngineConfig(**BASE)), Engine(EngineConfig(**BASE, speculative=NGRAM))


def _chat(tok, content: str) -> list[int]:
    msgs = [{"role": "user", "content": content}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])


@pytest.mark.slow
def test_copying_text_greedy_equals_transformers_and_most_drafts_are_kept(smollm2, engines):
    model, tok = smollm2
    prompt = _chat(tok, f"Repeat this text exactly, word for word:\n\n{TEXT}")
    expected = hf_greedy(model, prompt, 60, eos_token_id=tok.eos_token_id)
    _, spec = engines
    out = spec.generate([prompt], SamplingParams(max_tokens=60))[0]
    assert out.token_ids == expected
    counters = spec.stats().speculation
    assert counters.acceptance_rate > 0.5, counters
    assert counters.mean_accepted_length > 2.0, counters


@pytest.mark.slow
def test_structured_output_under_speculation_validates_and_equals_decoding_without(smollm2, engines):
    _, tok = smollm2
    prompt = _chat(tok, f"Here is a record: {json.dumps(RECORD)}\nWrite the same record as JSON.")
    params = SamplingParams(max_tokens=80, structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    plain, spec = engines
    before = spec.stats().speculation
    want, got = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids
    assert got.finish_reason == FinishReason.STOP, got.text
    jsonschema.validate(json.loads(got.text), SCHEMA)
    assert spec.stats().speculation.accepted_tokens > before.accepted_tokens


@pytest.mark.slow
def test_self_speculation_on_a_chat_prompt_greedy_equals_transformers(smollm2, monkeypatch):
    """SmolLM2's first 20 layers draft (it has no smaller sibling) on a chat question:
    the tokens are transformers'. The price of a draft token is taken as nothing, so
    that every step drafts the most tokens and verification is exercised throughout
    (the measured price would hold this draft to probes: ``speculative.cost``)."""
    from splitserve.engine.speculative.cost import StepCost

    monkeypatch.setattr(StepCost, "min_gain", property(lambda self: 0.0))
    model, tok = smollm2
    prompt = _chat(tok, "Explain in two sentences why the sky is blue.")
    expected = hf_greedy(model, prompt, 40, eos_token_id=tok.eos_token_id)
    engine = Engine(
        EngineConfig(**BASE, speculative=SpeculativeConfig("self", num_tokens=4, draft_layers=20))
    )
    out = engine.generate([prompt], SamplingParams(max_tokens=40))[0]
    assert out.token_ids == expected
    counters = engine.stats().speculation
    assert counters.verified_steps > 5 and counters.accepted_tokens > 0, counters
