"""Text off the step (``engine.text``): the engine's step emits token ids; a consumer's
``Texts`` makes the text, equal to a whole decode of the tokens, and ends a request at
a stop string, cutting its tokens where the stop string completed. References: the
tokenizer's whole decode, and the text itself searched for the stop string. Every test
runs with the detokenizer's two forms (``engine.tokenizer.IncrementalDetokenizer``):
the Rust ``DecodeStream`` (SmolLM2's tokenizer allows it) and the Python decodes."""

from __future__ import annotations

import pytest

from splitserve.engine import tokenizer as tokenizer_module
from splitserve.engine.engine import Engine
from splitserve.engine.text import Texts, TextStream, text_start
from splitserve.engine.tokenizer import IncrementalDetokenizer
from splitserve.wire.config import EngineConfig
from splitserve.wire.outputs import RequestOutput
from splitserve.wire.sampling import FinishReason, SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(EngineConfig(model="smollm2", dtype="float32", block_size=16))


@pytest.fixture(autouse=True, params=["rust", "python"])
def detokenizer(request, engine, monkeypatch):
    """The detokenizer's form for the test: "rust" (checked to be in use) or "python"."""
    if request.param == "python":
        monkeypatch.setattr(tokenizer_module, "_decode_stream", lambda *args: (None, None))
    else:
        assert IncrementalDetokenizer(engine.tokenizer, [1, 2], 2)._stream is not None
    return request.param


def test_incremental_text_equals_a_whole_decode_across_split_characters(engine):
    """Characters of several bytes (accents, CJK, emoji) whose bytes fall in different
    tokens are held back until whole, with and without special tokens skipped."""
    tok = engine.tokenizer
    ids = tok.encode_plain("Ünïcödé: 日本語のテキスト 🙂🚀🧪 — ok.") + [tok.eos_token_id]
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some token is part of a character
    for skip in (True, False):
        for context in (0, 3):
            d = IncrementalDetokenizer(tok, ids, context, skip)
            pieces = [d.step(ids[: n + 1]) for n in range(context, len(ids))]
            assert "".join(pieces) == tok.decode(ids, skip)[len(tok.decode(ids[:context], skip)) :]
            assert all("\ufffd" not in p for p in pieces)


def _chat(engine: Engine, q: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])


def _run_tokens(engine: Engine, prompts, params) -> tuple[dict, list[RequestOutput]]:
    """Every output of ``step_tokens`` until done, and the request ids in order."""
    ids = [engine.add_request(p, params) for p in prompts]
    outs = []
    while engine.has_unfinished():
        outs += engine.step_tokens()
    return ids, outs


def test_the_step_emits_token_ids_whose_text_equals_a_whole_decode(engine):
    params = SamplingParams(max_tokens=48)
    prompts = [_chat(engine, q) for q in QUESTIONS]
    ids, outs = _run_tokens(engine, prompts, params)
    assert outs and all(o.text == "" for o in outs)  # the step made no text
    firsts = {}
    for o in outs:
        firsts.setdefault(o.request_id, o)
    assert all(firsts[i].text_start is not None for i in ids)  # each first output says how to start
    assert all(o.text_start is None for o in outs if o is not firsts[o.request_id])
    texts, got, tokens = Texts(engine.tokenizer), dict.fromkeys(ids, ""), {i: [] for i in ids}
    for o in outs:
        assert texts.feed(o) is False
        got[o.request_id] += o.text
        tokens[o.request_id] += o.new_token_ids
    assert len(texts) == 0  # every stream closed by its request's last output
    for i in ids:
        assert got[i] == engine.tokenizer.decode(tokens[i])  # skips the EOS's special text
    # the library's step makes the same text in-line
    assert [c.text for c in engine.generate(prompts, params)] == [got[i] for i in ids]


def _outputs(tokens: list[int], per: int, rid: str = "r") -> list[RequestOutput]:
    """``tokens`` as a request's outputs of ``per`` tokens each (the last finished,
    LENGTH), with a logprob per token."""
    outs = []
    for k in range(0, len(tokens), per):
        new = tokens[k : k + per]
        last = k + per >= len(tokens)
        outs.append(
            RequestOutput(
                rid, new, "", last, FinishReason.LENGTH if last else None, 3, k + len(new), 0,
                new_logprobs=[-float(k + j) for j in range(len(new))],
            )
        )  # fmt: skip
    return outs


@pytest.mark.parametrize("per", [1, 3, 50])  # one token a step; a draft's several; all at once
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_output_after_the_token_that_completed_it(engine, per, include):
    tok = engine.tokenizer
    prompt = tok.encode_plain("Say it:")
    words = tok.encode_plain(" The quick brown fox jumps over the lazy dog, and then the fox sleeps.")
    whole = tok.decode(words)
    stop = "over the"
    params = SamplingParams(stop=(stop,), include_stop_str_in_output=include)
    stream = TextStream(tok, text_start(prompt + words, len(prompt), len(prompt), params))
    text, kept, stopped_at = "", [], None
    for n, out in enumerate(_outputs(words, per)):
        if stream.feed(out):
            stopped_at = n
        text += out.text
        kept += out.new_token_ids
        assert len(out.new_logprobs) == len(out.new_token_ids) and out.num_output_tokens == len(kept)
        if out.finished:
            break
    end = whole.index(stop) + (len(stop) if include else 0)
    assert text == whole[:end]
    assert stopped_at is not None and out.finish_reason == FinishReason.STOP and not out.stop_token
    # the tokens end with the one whose text completed the stop string: not before, not after
    assert stop in tok.decode(kept) and stop not in tok.decode(kept[:-1])


def test_the_last_characters_that_could_start_a_stop_string_wait_for_the_end(engine):
    tok = engine.tokenizer
    words = tok.encode_plain(" one two three four five six")
    params = SamplingParams(stop=("four five seven",))
    holdback = len(params.stop[0]) - 1
    stream = TextStream(tok, text_start(words, 0, 0, params))
    seen = ""
    for out in _outputs(words, 1):
        stream.feed(out)
        seen += out.text
        done = tok.decode(words[: out.num_output_tokens])
        if not out.finished:  # all but a stop string's length less one, in order
            assert done.startswith(seen) and len(done) - len(seen) == min(holdback, len(done))
    assert seen == tok.decode(words)  # the last output flushed what was held back


def test_a_stop_string_spanning_tokens_emitted_elsewhere_is_found(engine):
    """An imported or resumed request: the output tokens sent before this engine had it
    are the stop strings' context (``TextStart.num_output``)."""
    tok = engine.tokenizer
    prompt, before, after = tok.encode_plain("Q:"), tok.encode_plain(" red green"), tok.encode_plain(" blue")
    params = SamplingParams(stop=("green blue",))
    ids = prompt + before
    start = text_start(ids, len(prompt), len(ids), params)
    assert start.num_output == len(before) and start.token_ids[-len(before) :] == tuple(before)
    (out,) = _outputs(after, len(after))
    out.finished, out.finish_reason = False, None
    assert TextStream(tok, start).feed(out) is True and out.finish_reason == FinishReason.STOP
    assert out.text == ""  # the cut falls in text sent before: nothing of "blue" goes out


def test_a_stop_token_s_text_is_left_out_unless_asked(engine):
    tok = engine.tokenizer
    words = tok.encode_plain(" fine") + [tok.eos_token_id]
    for include, skip in ((False, False), (True, False), (True, True)):
        params = SamplingParams(include_stop_str_in_output=include, skip_special_tokens=skip)
        (out,) = _outputs(words, len(words))
        out.finish_reason, out.stop_token = FinishReason.STOP, True
        TextStream(tok, text_start(words, 0, 0, params)).feed(out)
        eos_text = tok.decode([tok.eos_token_id], skip)
        assert out.text == " fine" + (eos_text if include else ""), (include, skip)


def test_a_library_step_ends_a_stop_string_in_the_same_step(engine):
    prompt = _chat(engine, QUESTIONS[0])
    free = engine.generate([prompt], SamplingParams(max_tokens=30))[0]
    assert "Paris" in free.text
    rid = engine.add_request(prompt, SamplingParams(max_tokens=30, stop=("Paris",)))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.STOP
    assert "".join(o.text for o in outs) == free.text[: free.text.index("Paris")]
    kept = [t for o in outs for t in o.new_token_ids]
    assert kept == free.token_ids[: len(kept)] and "Paris" in engine.tokenizer.decode(kept)
    assert rid not in engine.requests and engine.block_manager.num_used_blocks == 0
