"""Tool calls and reasoning in chat output: what the model's text means.

``tool_choice`` (OpenAI's) decides how a chat request may call its ``tools``:

- ``none``: the tools are not shown to the model; its text is the answer;
- ``auto`` (the default with tools): the template shows them; the output is
  parsed for calls in the server's format (``router.openai.tool_call_parser``):
  ``hermes`` (Hermes, Qwen: ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``,
  any text around them is content) or ``llama3_json`` (Llama 3: the whole output
  one ``{"name": .., "parameters": {..}}``, or several joined by ``;``, after an
  optional ``<|python_tag|>``). Text that does not parse stays content;
- ``required`` / a named function: structured output holds the model to a JSON
  array of ``{"name", "parameters"}`` (``required``, as vLLM) or to the named
  function's parameters, so the call is always valid JSON against the tool's
  schema.

A ``<think>`` model's reasoning (``router.openai.reasoning_parser: think``): an
output that begins with ``<think>`` is reasoning up to ``</think>`` and content
after it (``reasoning_content`` beside ``content``); one that does not is all
content (Qwen 3 with thinking off).

gpt-oss's harmony format (``reasoning_parser: harmony``, which reads tool calls
too, whatever ``tool_call_parser`` says): the output is messages, each a header
and a body, ``[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]
<|message|>BODY`` ended by ``<|end|>``, ``<|return|>`` or ``<|call|>``. As vLLM
reads it: the ``analysis`` channel is ``reasoning_content``, ``final`` (and
``commentary`` addressed to no one: a preamble) is ``content``, and a message to
``functions.NAME`` is a call of NAME with the body as its arguments. The output
is detokenized with its special tokens kept (``keeps_special_tokens``), or the
markers would be lost.

``parse`` reads a whole output; ``OutputStream`` reads it as it grows and gives
the chunks' deltas, holding back only what may still turn out to be a marker.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import SamplingParams, StructuredOutput

ToolParser = Literal["hermes", "llama3_json"]
ReasoningParser = Literal["think", "harmony"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_THINK, _UNTHINK = "<think>", "</think>"
_PYTHON_TAG = "<|python_tag|>"
_H_START, _H_CHANNEL, _H_MESSAGE, _H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
_H_ENDS = ("<|end|>", "<|return|>", "<|call|>")


@dataclass(frozen=True)
class ToolChoice:
    """How a request may call its tools: ``mode`` none / auto / required / named (then
    ``name`` is the function)."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class OutputFormat:
    """What a chat request's output is read as."""

    choice: ToolChoice = ToolChoice("none")
    tool_parser: ToolParser = "hermes"
    reasoning: ReasoningParser | None = None  # how reasoning is split out as reasoning_content
    include_reasoning: bool = True  # vLLM's: False drops the reasoning from the response

    @property
    def plain(self) -> bool:
        """Nothing to read: no tools, no reasoning; the text is the content as it comes."""
        return self.choice.mode == "none" and self.reasoning is None

    @property
    def keeps_special_tokens(self) -> bool:
        """The output must be detokenized with its special tokens (harmony's markers are)."""
        return self.reasoning == "harmony"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Parsed:
    """An output as far as it can be read now."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


# ---- the request side ---------------------------------------------------------------------------
def tool_choice(tools: list[dict[str, Any]] | None, choice: Any) -> ToolChoice:
    """The request's ``tool_choice`` checked against its ``tools``; ``InvalidRequest``
    naming what is wrong."""
    names = [function_of(t)["name"] for t in tools or ()]
    if choice is None:
        return ToolChoice("auto" if names else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not names:
            raise InvalidRequest(f"tool_choice {choice!r} needs tools")
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise InvalidRequest(f"tool_choice names the function {name!r}, which is not among the tools")
        return ToolChoice("named", name)
    raise InvalidRequest(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ..}}'
    )


def function_of(tool: Any) -> dict[str, Any]:
    """A tool's ``function`` (``InvalidRequest`` unless it is a function tool with a name)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequest('each tool must be {"type": "function", "function": {...}}')
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequest("each tool's function needs a name")
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, dict):
        raise InvalidRequest(f"the parameters of tool {fn['name']!r} must be a JSON schema (an object)")
    return fn


def forced_output(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool) -> StructuredOutput:
    """The structured output that makes a ``required`` or named choice's text a valid call."""

    def params(fn: dict[str, Any]) -> dict[str, Any]:
        return fn.get("parameters") or {"type": "object"}

    fns = [function_of(t) for t in tools]
    if choice.mode == "named":
        (fn,) = [f for f in fns if f["name"] == choice.name]
        return StructuredOutput("json_schema", json.dumps(params(fn)))
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": params(f)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in fns
        ]
    }
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": call}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput("json_schema", json.dumps(schema))


def with_forced_call(
    params: SamplingParams, tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool
) -> SamplingParams:
    """``params`` with the structured output of a ``required`` or named ``choice``
    (``forced_output``); ``InvalidRequest`` if they ask for another output form."""
    if params.structured is not None:
        raise InvalidRequest(
            f"tool_choice {choice.name or choice.mode!r} fixes the output's form: "
            "leave out response_format and structured outputs"
        )
    return dataclasses.replace(params, structured=forced_output(tools, choice, parallel))


def template_messages(messages: list[dict[str, Any]], text_of) -> list[dict[str, Any]]:
    """OpenAI chat messages as chat templates read them: content as text, an assistant's
    ``tool_calls`` with their arguments as objects (as Hugging Face templates expect),
    a tool result's ``tool_call_id`` and ``name`` kept."""
    out = []
    for m in messages:
        content = m.get("content")
        msg: dict[str, Any] = {
            "role": str(m.get("role", "")),
            "content": "" if content is None else text_of(content),
        }
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = [_template_call(c) for c in calls]
        for key in ("tool_call_id", "name"):
            if key in m:
                msg[key] = m[key]
        out.append(msg)
    return out


def _template_call(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("an assistant message's tool_calls need a function with a name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise InvalidRequest(f"the arguments of the call to {fn['name']!r} are not JSON") from None
    return {"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# ---- the output side ------------------------------------------------------------------------------
def parse(text: str, fmt: OutputFormat, final: bool = True) -> Parsed:
    """``text`` (the output so far) read as ``fmt`` says. Not ``final``: what might still
    become a marker, or an unfinished call, is held back (neither content nor call)."""
    if fmt.reasoning == "harmony":
        out = _harmony(text, final)
        if not fmt.include_reasoning:
            out.reasoning = ""
        return out
    out = Parsed()
    if fmt.reasoning == "think":
        out.reasoning, text = _split_reasoning(text, final)
    mode = fmt.choice.mode
    if mode == "none":
        out.content = text if final else _hold(text, ())
    elif mode == "named":  # the whole output is the arguments, as they come
        out.calls = [ToolCall(fmt.choice.name, text)]
    elif mode == "required":
        if final:
            out.calls = _calls(text, "parameters") or []
            out.content = "" if out.calls else text
    elif fmt.tool_parser == "hermes":
        out.content, out.calls = _hermes(text, final)
    else:
        out.content, out.calls = _llama3(text, final)
    if not fmt.include_reasoning:
        out.reasoning = ""
    return out


def _split_reasoning(text: str, final: bool) -> tuple[str, str]:
    """(reasoning, the rest) of an output that begins with <think>."""
    start = text.lstrip()
    if not start.startswith(_THINK):
        if not final and _THINK.startswith(start):  # "<thi": may still be
            return "", ""
        return "", text
    body = start[len(_THINK) :]
    if _UNTHINK in body:
        reasoning, rest = body.split(_UNTHINK, 1)
        return reasoning, rest.lstrip("\n") if final or rest.strip("\n") else ""
    return (body if final else _hold(body, (_UNTHINK,))), ""


def _harmony(text: str, final: bool) -> Parsed:
    """A harmony output's messages (module docstring). Not ``final``: a message still
    being written gives its body so far (less a tail that may begin a marker), a call
    only once it has ended."""
    out = Parsed()
    for i, chunk in enumerate(text.split(_H_START)):
        if i:
            chunk = chunk.removeprefix("assistant")  # the role of a later message
        if _H_MESSAGE not in chunk:  # a header still being written (or nothing)
            continue
        header, body = chunk.split(_H_MESSAGE, 1)
        ended = next((body.split(end, 1)[0] for end in _H_ENDS if end in body), None)
        body = ended if ended is not None else (body if final else _hold(body, (*_H_ENDS, _H_START)))
        channel, recipient = _harmony_header(header)
        if recipient is not None and recipient.startswith("functions."):
            if ended is not None or final:
                out.calls.append(ToolCall(recipient.removeprefix("functions."), body.strip()))
        elif channel == "analysis":
            out.reasoning += body
        elif recipient is None:  # final, or a preamble to the user (commentary)
            out.content += body
    return out


def _harmony_header(header: str) -> tuple[str, str | None]:
    """(channel, recipient or None) of a message header: ``<|channel|>commentary
    to=functions.f <|constrain|>json`` or `` to=functions.f<|channel|>commentary json``."""
    words = header.replace(_H_CHANNEL, " <|channel|> ").replace(_H_CONSTRAIN, " ").split()
    channel = next((words[k + 1] for k, w in enumerate(words[:-1]) if w == _H_CHANNEL), "")
    recipient = next((w.removeprefix("to=") for w in words if w.startswith("to=")), None)
    return channel, recipient


def _hold(text: str, markers: tuple[str, ...]) -> str:
    """``text`` without a tail that is the beginning of one of ``markers``."""
    for cut in range(min(len(text), max((len(m) for m in markers), default=0)), 0, -1):
        if any(m.startswith(text[-cut:]) for m in markers):
            return text[:-cut]
    return text


def _hermes(text: str, final: bool) -> tuple[str, list[ToolCall]]:
    content, calls, rest = [], [], text
    while _OPEN in rest:
        before, after = rest.split(_OPEN, 1)
        content.append(before)
        if _CLOSE not in after:
            if final:  # an unfinished call: its text stays content
                content.append(_OPEN + after)
            return "".join(content), calls
        body, rest = after.split(_CLOSE, 1)
        call = _calls(body.strip(), "arguments")
        if call is None or len(call) != 1:
            content.append(_OPEN + body + _CLOSE)
        else:
            calls += call
    content.append(rest if final else _hold(rest, (_OPEN,)))
    joined = "".join(content)
    return (joined.strip() if final and calls else joined), calls


def _llama3(text: str, final: bool) -> tuple[str, list[ToolCall]]:
    start = text.lstrip()
    if start.startswith(_PYTHON_TAG):
        start = start[len(_PYTHON_TAG) :].lstrip()
    elif not start.startswith("{"):
        if not final and (not start or _PYTHON_TAG.startswith(start)):
            return "", []
        return text, []
    if not final:
        return "", []
    calls = _calls("[" + ",".join(p for p in _split_top(start, ";") if p.strip()) + "]", "parameters")
    return ("", calls) if calls else (text, [])


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside JSON strings and brackets."""
    parts, depth, in_str, escaped, begin = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if in_str:
            escaped, in_str = (not escaped and ch == "\\"), in_str and (escaped or ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[begin:i])
            begin = i + 1
    parts.append(text[begin:])
    return parts


def _calls(text: str, args_key: str) -> list[ToolCall] | None:
    """Calls from JSON: an object or a list of objects with ``name`` and ``args_key``
    (or the other of "arguments" / "parameters"); None if it is not that."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get(args_key, item.get("arguments", item.get("parameters", {})))
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


class OutputStream:
    """A chat choice's output read as it grows: ``feed`` the text delta of each batch,
    get the ``delta`` objects to send (``content``, ``reasoning_content``,
    ``tool_calls`` entries with their ``index``); ``finish`` at the end gives what was
    held back and whether the output called tools. A ``plain`` format passes each
    delta on as content; any other re-reads the whole text at every delta (linear in
    its length: the price of holding back no more than a marker's prefix)."""

    def __init__(self, fmt: OutputFormat):
        self.fmt = fmt
        self._text = ""
        self._sent = Parsed()
        self._args_sent: list[int] = []  # per call: arguments characters sent

    def feed(self, delta: str) -> list[dict[str, Any]]:
        if self.fmt.plain:  # every chat without tools or reasoning: nothing to re-read
            return [{"content": delta}] if delta else []
        self._text += delta
        return self._deltas(parse(self._text, self.fmt, final=False))

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        if self.fmt.plain:
            return [], False
        parsed = parse(self._text, self.fmt, final=True)
        return self._deltas(parsed), bool(parsed.calls)

    def _deltas(self, now: Parsed) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for key, attr in (("reasoning_content", "reasoning"), ("content", "content")):
            new, old = getattr(now, attr), getattr(self._sent, attr)
            if len(new) > len(old) and new.startswith(old):
                out.append({key: new[len(old) :]})
                setattr(self._sent, attr, new)
        for i, call in enumerate(now.calls):
            if i >= len(self._sent.calls):
                self._sent.calls.append(call)
                self._args_sent.append(len(call.arguments))
                out.append({"tool_calls": [{"index": i} | call.message()]})
            elif len(call.arguments) > self._args_sent[i]:
                piece = call.arguments[self._args_sent[i] :]
                self._args_sent[i] = len(call.arguments)
                out.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        return out

    @property
    def calls(self) -> list[ToolCall]:
        return self._sent.calls
