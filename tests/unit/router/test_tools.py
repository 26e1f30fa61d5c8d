"""Reading chat output as tool calls and reasoning (``router.tools``): whole, and as
it streams (every way of cutting the text into deltas gives the same result)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from splitserve.router.tools import (
    OutputFormat,
    OutputStream,
    ToolChoice,
    forced_output,
    parse,
    template_messages,
    tool_choice,
)
from splitserve.wire.errors import InvalidRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
AUTO = OutputFormat(ToolChoice("auto"), "hermes")

HERMES = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def test_hermes_calls_and_the_text_around_them():
    out = parse(HERMES, AUTO)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert out.content == "Let me look." and len({c.id for c in out.calls}) == 2


def test_text_that_does_not_parse_stays_content():
    for text in ("no tools here", "<tool_call>{not json}</tool_call>", '<tool_call>{"name": "x"'):
        out = parse(text, AUTO)
        assert out.calls == [] and out.content == text


def test_llama3_json_calls():
    fmt = OutputFormat(ToolChoice("auto"), "llama3_json")
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo; Norway"}}; {"name": "get_time"}'
    )
    out = parse(text, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Oslo; Norway"}),
        ("get_time", {}),
    ]
    assert out.content == ""
    assert parse("Hello {there}", fmt).content == "Hello {there}"
    assert parse('{"no": "name"}', fmt).content == '{"no": "name"}'


def test_reasoning_is_split_from_content():
    fmt = OutputFormat(ToolChoice("none"), reasoning="think")
    out = parse("<think>2 + 2 is 4.</think>\n\nIt is 4.", fmt)
    assert (out.reasoning, out.content) == ("2 + 2 is 4.", "It is 4.")
    assert parse("It is 4.", fmt).reasoning == "" and parse("It is 4.", fmt).content == "It is 4."
    unfinished = parse("<think>still thinking", fmt)
    assert (unfinished.reasoning, unfinished.content) == ("still thinking", "")
    hidden = OutputFormat(ToolChoice("none"), reasoning="think", include_reasoning=False)
    assert parse("<think>x</think>y", hidden).reasoning == ""
    with_tools = OutputFormat(ToolChoice("auto"), "hermes", reasoning="think")
    out = parse("<think>need weather</think>" + HERMES, with_tools)
    assert out.reasoning == "need weather" and [c.name for c in out.calls] == ["get_weather", "get_time"]


HARMONY = OutputFormat(ToolChoice("auto"), reasoning="harmony")
# what gpt-oss writes after its prompt's <|start|>assistant (its chat format, "harmony")
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>The user asks 2+2. Easy: 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
)
HARMONY_CALLS = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
    "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
)


def test_harmony_channels_are_reasoning_content_and_calls():
    out = parse(HARMONY_ANSWER, HARMONY)
    assert (out.reasoning, out.content, out.calls) == ("The user asks 2+2. Easy: 4.", "It is 4.", [])
    out = parse(HARMONY_CALLS, HARMONY)
    assert (out.reasoning, out.content) == ("Need the weather.", "Checking.")
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    # the stop token may be left out of the text: the last message ends with it all the same
    assert parse(HARMONY_ANSWER.removesuffix("<|return|>"), HARMONY).content == "It is 4."
    unfinished = parse("<|channel|>analysis<|message|>still thinking<|en", HARMONY, final=False)
    assert (unfinished.reasoning, unfinished.content) == ("still thinking", "")
    hidden = OutputFormat(ToolChoice("none"), reasoning="harmony", include_reasoning=False)
    assert (
        parse(HARMONY_ANSWER, hidden).reasoning == "" and parse(HARMONY_ANSWER, hidden).content == "It is 4."
    )
    assert HARMONY.keeps_special_tokens and not OutputFormat(reasoning="think").keeps_special_tokens


CASES = [
    (OutputFormat(), "plain text, <tool_call> and <think> included, is all content"),
    (HARMONY, HARMONY_ANSWER),
    (HARMONY, HARMONY_CALLS),
    (AUTO, HERMES),
    (AUTO, "plain answer with < and <tool but no call"),
    (OutputFormat(ToolChoice("auto"), "llama3_json"), '{"name": "get_time", "parameters": {}}'),
    (OutputFormat(ToolChoice("auto"), "llama3_json"), "Sure, it is noon."),
    (OutputFormat(ToolChoice("none"), reasoning="think"), "<think>a</think>\n\nb<c"),
    (OutputFormat(ToolChoice("auto"), "hermes", reasoning="think"), "<think>x</thi</think>" + HERMES),
    (OutputFormat(ToolChoice("named", "get_weather")), '{"city": "Paris"}'),
    (OutputFormat(ToolChoice("required")), '[{"name": "get_time", "parameters": {}}]'),
]


@pytest.mark.parametrize("fmt, text", CASES)
def test_streamed_deltas_add_up_to_the_whole_reading(fmt, text):
    whole = parse(text, fmt)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = OutputStream(fmt)
        deltas = [d for p in pieces for d in stream.feed(p)]
        rest, called = stream.finish()
        deltas += rest
        got = {"content": "", "reasoning_content": "", "calls": {}}
        for d in deltas:
            for key in ("content", "reasoning_content"):
                got[key] += d.get(key, "")
            for call in d.get("tool_calls", []):
                entry = got["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
                if "id" in call:
                    entry["name"] = call["function"]["name"]
                entry["arguments"] += call["function"]["arguments"]
        assert got["content"].strip() == whole.content.strip(), pieces
        assert got["reasoning_content"] == whole.reasoning, pieces
        calls = [(c.name, c.arguments) for c in whole.calls]
        assert [(v["name"], v["arguments"]) for _, v in sorted(got["calls"].items())] == calls, pieces
        assert called == bool(whole.calls)


def test_a_forced_choice_is_a_schema_every_valid_call_meets():
    required = json.loads(forced_output([WEATHER, TIME], ToolChoice("required"), True).spec)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}], required)
    jsonschema.validate(
        [{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}], required
    )
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = json.loads(forced_output([WEATHER, TIME], ToolChoice("required"), False).spec)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)
    named = forced_output([WEATHER, TIME], ToolChoice("named", "get_weather"), True)
    assert json.loads(named.spec) == WEATHER["function"]["parameters"]


def test_tool_choice_is_checked_against_the_tools():
    assert tool_choice(None, None) == ToolChoice("none")
    assert tool_choice([WEATHER], None) == ToolChoice("auto")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice([WEATHER], named) == ToolChoice("named", "get_weather")
    for tools, choice, words in [
        (None, "required", "needs tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        ([{"type": "retrieval"}], None, "function"),
    ]:
        with pytest.raises(InvalidRequest, match=words):
            tool_choice(tools, choice)


def test_messages_reach_the_template_as_it_reads_them():
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    got = template_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "time?"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        ],
        lambda c: c if isinstance(c, str) else "".join(p["text"] for p in c),
    )
    assert got[0] == {"role": "user", "content": "time?"}
    assert got[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {"tz": "UTC"}}
    assert got[2] == {"role": "tool", "content": "12:00", "tool_call_id": "c1"}
    bad = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}
    with pytest.raises(InvalidRequest, match="not JSON"):
        template_messages([bad], str)
