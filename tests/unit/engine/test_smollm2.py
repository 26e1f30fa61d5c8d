"""The real SmolLM2-135M-Instruct (GGUF, through transformers) against
transformers' generate: chat prompts, natural EOS, float32, token for token."""

from __future__ import annotations

import pytest

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import FinishReason, SamplingParams
from tests.conftest import hf_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Name three primary colors.",
    "Explain in one sentence why the sky is blue.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "List the planets of the solar system in order from the sun, with one fact about each.",
    "Translate 'good morning' into Spanish and German.",
]
MAX_NEW = 40


@pytest.fixture(scope="module")
def engines(smollm2):
    base = dict(model="smollm2", dtype="float32", block_size=16, max_num_batched_tokens=48)
    return {
        "prefix": Engine(EngineConfig(**base, enable_prefix_caching=True)),
        "no_prefix_tight": Engine(EngineConfig(**base, enable_prefix_caching=False, num_kv_blocks=24)),
    }


@pytest.fixture(scope="module")
def chats(smollm2):
    model, tok = smollm2
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        for q in QUESTIONS
    ]
    prompts = [list(p) for p in prompts]
    expected = [hf_greedy(model, p, MAX_NEW, eos_token_id=tok.eos_token_id) for p in prompts]
    return prompts, expected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prefix", "no_prefix_tight"])
def test_smollm2_greedy_matches_hf(engines, chats, name):
    engine = engines[name]
    prompts, expected = chats
    assert max(len(p) for p in prompts) > 48  # some prompts are chunked
    params = SamplingParams(max_tokens=MAX_NEW)
    for _ in range(2):  # the second pass reuses cached prefixes (the shared system prompt)
        out = engine.generate(prompts, params)
        got = [o.token_ids[: len(e)] for o, e in zip(out, expected)]
        assert got == expected
    if name == "prefix":
        assert all(o.num_cached_tokens > 0 for o in out)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_smollm2_answers_paris_through_chat_template(engines):
    engine = engines["prefix"]
    rid = engine.add_request(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        params=SamplingParams(max_tokens=30),
    )
    text, reason = "", None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            text += out.text
            reason = out.finish_reason
    assert "Paris" in text
    assert reason == FinishReason.STOP
    assert "<|im_end|>" not in text


def stream(engine: Engine, question: str, params: SamplingParams) -> tuple[str, list, FinishReason]:
    rid = engine.add_request(messages=[{"role": "user", "content": question}], params=params)
    text, tokens, reason = "", [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            text += out.text
            tokens += out.new_token_ids
            reason = out.finish_reason
    return text, tokens, reason


@pytest.mark.slow
def test_streamed_text_equals_decoding_the_tokens(engines):
    engine = engines["prefix"]
    text, tokens, _ = stream(engine, QUESTIONS[6], SamplingParams(max_tokens=60))
    assert text == engine.tokenizer.decode(tokens)


@pytest.mark.slow
def test_stop_string_truncates_and_is_never_streamed(engines):
    engine = engines["prefix"]
    free, _, _ = stream(engine, "What is the capital of France?", SamplingParams(max_tokens=30))
    assert "Paris" in free
    text, _, reason = stream(
        engine, "What is the capital of France?", SamplingParams(max_tokens=30, stop=["Paris"])
    )
    assert reason == FinishReason.STOP
    assert text == free[: free.index("Paris")]


@pytest.mark.slow
def test_include_stop_str_in_output_keeps_the_stop_string(engines):
    engine = engines["prefix"]
    free, _, _ = stream(engine, "What is the capital of France?", SamplingParams(max_tokens=30))
    params = SamplingParams(max_tokens=30, stop=["Paris"], include_stop_str_in_output=True)
    text, _, reason = stream(engine, "What is the capital of France?", params)
    assert reason == FinishReason.STOP and text == free[: free.index("Paris") + len("Paris")]


@pytest.mark.slow
def test_special_tokens_stay_in_the_text_when_asked(engines):
    """The EOS token that ended the output is in its text only with
    include_stop_str_in_output, and then only its special-token text with
    skip_special_tokens false (as vLLM)."""
    engine = engines["prefix"]
    plain, tokens, reason = stream(engine, "Hi", SamplingParams(max_tokens=80))
    assert reason == FinishReason.STOP  # ended at the EOS token, a special token
    eos = engine.tokenizer.hf.convert_ids_to_tokens(tokens[-1])
    assert eos.startswith("<|") and eos not in plain
    for skip, include, want in ((False, False, plain), (True, True, plain), (False, True, plain + eos)):
        params = SamplingParams(max_tokens=80, skip_special_tokens=skip, include_stop_str_in_output=include)
        text, same, _ = stream(engine, "Hi", params)
        assert same == tokens and text == want, (skip, include)


@pytest.mark.slow
def test_bad_words_are_never_generated(engines):
    engine = engines["prefix"]
    free, _, _ = stream(engine, "What is the capital of France?", SamplingParams(max_tokens=30))
    assert "Paris" in free
    text, _, _ = stream(
        engine, "What is the capital of France?", SamplingParams(max_tokens=30, bad_words=["Paris"])
    )
    assert "Paris" not in text and text[:10] == free[:10]


@pytest.mark.slow
def test_ignore_eos_runs_to_max_tokens(engines):
    engine = engines["prefix"]
    _, natural, reason = stream(engine, "Hi", SamplingParams(max_tokens=80))
    assert reason == FinishReason.STOP and len(natural) < 80
    _, forced, reason = stream(engine, "Hi", SamplingParams(max_tokens=80, ignore_eos=True))
    assert reason == FinishReason.LENGTH and len(forced) == 80
    assert forced[: len(natural)] == natural
