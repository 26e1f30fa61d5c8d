"""The OpenAI-compatible endpoint's request bodies: the fields each front door
reads (``openai.schema``: the honoured ones) as pydantic models, and how they become
``SamplingParams`` (what the client left unset is named by ``unset()``; the
dispatcher fills it, the same for gRPC)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitserve.router.openai.schema import Endpoint
from splitserve.router.tools import (
    OutputFormat,
    ReasoningParser,
    ToolChoice,
    ToolParser,
    template_messages,
    tool_choice,
    with_forced_call,
)
from splitserve.wire.chat import ChatTemplating
from splitserve.wire.defaults import DEFAULTED, SAMPLING_FIELDS
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import SamplingParams, StructuredOutput


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # usage so far in every chunk


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = ""
    description: str = ""
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its forms."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _structured(fmt: ResponseFormat | None, outputs: StructuredOutputs | None) -> StructuredOutput | None:
    """The request's structured output, from ``response_format`` or ``structured_outputs``."""
    if fmt is not None and fmt.type != "text" and outputs is not None:
        raise InvalidRequest("give response_format or structured_outputs, not both")
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutput("json_schema", '{"type": "object"}')
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequest("response_format of type json_schema needs json_schema.schema")
        return StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))
    if outputs is None:
        return None
    forms = {
        "json": outputs.json_,
        "regex": outputs.regex,
        "choice": outputs.choice,
        "grammar": outputs.grammar,
        "json_object": outputs.json_object or None,
    }
    given = [k for k, v in forms.items() if v is not None]
    if len(given) != 1:
        raise InvalidRequest(
            f"structured_outputs needs exactly one of {', '.join(forms)}; got {given or 'none'}"
        )
    (kind,) = given
    if kind == "json":
        spec = outputs.json_ if isinstance(outputs.json_, str) else json.dumps(outputs.json_)
        return StructuredOutput("json_schema", spec)
    if kind == "json_object":
        return StructuredOutput("json_schema", '{"type": "object"}')
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(outputs.choice))
    return StructuredOutput(kind, forms[kind])


class OpenAIRequest(BaseModel):
    """The fields a front door reads (``openai.schema``: honoured); every other field of
    the body is checked against ``schema.FIELDS``."""

    model_config = ConfigDict(extra="allow")
    ENDPOINT: ClassVar[Endpoint]

    model: str = ""
    request_id: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # JSON keys are strings; pydantic reads them as ints
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    seed: int | None = None
    n: int = 1
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs, in the response
    speculate: bool = True  # splitserve's: false decodes it without speculative decoding (same tokens)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _no_streamed_prompt_logprobs(self) -> OpenAIRequest:
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available when streaming (as in vLLM)")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> tuple[bool, int]:
        """(the chosen tokens' logprobs, how many most likely tokens' per step)."""
        return False, 0

    def _given(self) -> dict[str, Any]:
        """The defaulted fields (``wire.defaults.DEFAULTED``) this request sets."""
        values = {"max_tokens": self.requested_max_tokens()} | {f: getattr(self, f) for f in SAMPLING_FIELDS}
        return {k: v for k, v in values.items() if v is not None}

    def params(self) -> SamplingParams:
        """What the client set; ``unset()`` names the rest, which the dispatcher fills."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            **self._given(),
            seed=self.seed,
            n=self.n,
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=self.logit_bias or {},
            min_tokens=self.min_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or (),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured=_structured(self.response_format, self.structured_outputs),
            logprobs=self.requested_logprobs()[0],
            top_logprobs=self.requested_logprobs()[1],
            prompt_logprobs=self.prompt_logprobs,
            speculate=self.speculate,
        )

    def unset(self) -> frozenset[str]:
        return frozenset(DEFAULTED) - self._given().keys()


class ChatRequest(OpenAIRequest):
    ENDPOINT = Endpoint.CHAT

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # a template variable (as vLLM passes it)
    include_reasoning: bool = True

    def choice(self) -> ToolChoice:
        return tool_choice(self.tools, self.tool_choice)

    def params(self) -> SamplingParams:
        """As any request's; a ``required`` or named ``tool_choice`` adds the structured
        output that keeps the call valid (``router.tools``)."""
        params = super().params()
        choice = self.choice()
        if choice.forced:
            params = with_forced_call(params, self.tools, choice, self.parallel_tool_calls)
        return params

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages, text_of)

    def templating(self) -> ChatTemplating:
        """The tools (unless ``tool_choice`` is none), the request's template and its
        template variables (``chat_template_kwargs``, ``reasoning_effort``)."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
        tools = self.tools if self.tools and self.choice().mode != "none" else None
        return ChatTemplating(tools=tools, template=self.chat_template, variables=variables)

    def output_format(
        self, tool_parser: ToolParser, reasoning_parser: ReasoningParser | None
    ) -> OutputFormat:
        return OutputFormat(self.choice(), tool_parser, reasoning_parser, self.include_reasoning)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0


class CompletionRequest(OpenAIRequest):
    ENDPOINT = Endpoint.COMPLETIONS

    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or several (one choice each)
    logprobs: int | None = None  # the chosen token's and this many most likely tokens'
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too)

    def requested_logprobs(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts (OpenAI's forms: a string, token ids, or a list of either)."""
        p = self.prompt
        if isinstance(p, str) or all(isinstance(t, int) for t in p):
            return [p]
        if not p:
            raise InvalidRequest("the prompt list is empty")
        return list(p)

    def params(self) -> SamplingParams:
        params = super().params()
        if self.echo and self.logprobs is not None:
            params = dataclasses.replace(
                params, prompt_logprobs=max(self.logprobs, self.prompt_logprobs or 0)
            )
        return params


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    tokens: list[int]


class LoadLoRARequest(BaseModel):
    """vLLM's ``/v1/load_lora_adapter`` body (``lora_int_id``, which it also takes, has
    no meaning here: an adapter is its name)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    lora_int_id: int | None = None


class UnloadLoRARequest(BaseModel):
    """vLLM's ``/v1/unload_lora_adapter`` body."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def text_of(content: Any) -> str:
    """Message content as text: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    raise InvalidRequest("message content must be text (a string or text parts)")


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        fields = json.loads(raw)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidRequest("the request body is not valid JSON (UTF-8)") from None
    if not isinstance(fields, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return fields


def validated(cls: type[BaseModel], fields: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(fields)
    except ValidationError as e:
        raise InvalidRequest(pydantic_message(e)) from None


def pydantic_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "invalid request: " + "; ".join(parts)
