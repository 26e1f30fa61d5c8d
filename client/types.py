"""Plain results the SDK returns (the protos stay an implementation detail)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.client.errors import InvalidArgument
from splitserve.proto import splitserve_pb2 as pb

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Chunk:
    """New tokens of a streamed completion."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    times_ms: list[float]  # per token: ms since the router accepted the request
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked
    index: int = 0  # the sequence (of ``n``) these tokens are of
    # prompt tokens 1.. : (logprob, most likely (token id, logprob)), on the first chunk, when asked
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass(frozen=True)
class Final:
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    ttft_ms: float
    transfer_ms: float  # first token -> the decode worker holds the KV (0 when prefilled there)
    e2e_ms: float
    prefill_worker: str
    decode_worker: str
    # where the time went: queue + prefill + transfer + decode = e2e
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    kv_pull_ms: float = 0.0  # the part of transfer_ms spent moving and verifying the KV
    index: int = 0  # the sequence (of ``n``) that ended
    # the calls read from the output of a request with tools: {"id", "name", "arguments" (JSON)}
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    # speculative decoding: tokens proposed for it and kept (0 where its worker did not speculate)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    final: Final | None = None
    index: int = 0  # the sequence (of ``n``) it is

    @property
    def finish_reason(self) -> str | None:
        return self.final.finish_reason if self.final else None

    def add(self, item: Chunk | Final) -> None:
        if isinstance(item, Final):
            self.final = item
        else:
            self.text += item.text
            self.token_ids.extend(item.token_ids)
            self.logprobs.extend(item.logprobs)
            self.times_ms.extend(item.times_ms)
            self.top_logprobs.extend(item.top_logprobs)
            self.prompt_logprobs = self.prompt_logprobs or item.prompt_logprobs


def _message(m: dict[str, Any]) -> pb.ChatMessage:
    """An OpenAI-style chat message (an assistant's ``tool_calls``, a tool result's
    ``tool_call_id``) as the proto's."""
    calls = m.get("tool_calls")
    return pb.ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        tool_calls_json=json.dumps(calls) if calls else "",
        tool_call_id=m.get("tool_call_id", ""),
        name=m.get("name", ""),
    )


def collect(request_id: str, items, n: int) -> list[Completion]:
    """A stream's items as ``n`` completions, by their ``index``. Nothing is allocated per
    sequence before the server answers: an ``n`` it refuses (at most 64) costs nothing."""
    out: dict[int, Completion] = {}
    for item in items:
        out.setdefault(item.index, Completion(request_id=request_id, index=item.index)).add(item)
    return [out.get(i) or Completion(request_id=request_id, index=i) for i in range(n)]


def item_of(resp: pb.GenerateResponse) -> Chunk | Final:
    if resp.WhichOneof("kind") == "token":
        t = resp.token
        top = [list(zip(s.token_ids, s.logprobs)) for s in t.top_logprobs]
        prompt = [(p.logprob, list(zip(p.top.token_ids, p.top.logprobs))) for p in t.prompt_logprobs]
        return Chunk(
            list(t.token_ids), t.text, list(t.logprobs), list(t.times_ms), top, t.index, prompt or None
        )
    f = resp.final
    return Final(
        finish_reason=_FINISH.get(f.finish_reason, "unspecified"),
        prompt_tokens=f.usage.prompt_tokens,
        completion_tokens=f.usage.completion_tokens,
        cached_prompt_tokens=f.usage.cached_prompt_tokens,
        ttft_ms=f.timing.ttft_ms,
        transfer_ms=f.timing.transfer_ms,
        e2e_ms=f.timing.e2e_ms,
        prefill_worker=f.prefill_worker,
        decode_worker=f.decode_worker,
        queue_ms=f.timing.queue_ms,
        prefill_ms=f.timing.prefill_ms,
        decode_ms=f.timing.decode_ms,
        kv_pull_ms=f.timing.kv_pull_ms,
        index=f.index,
        tool_calls=[{"id": c.id, "name": c.name, "arguments": c.arguments} for c in f.tool_calls],
        draft_tokens=f.usage.draft_tokens,
        accepted_draft_tokens=f.usage.accepted_draft_tokens,
    )


def build_request(
    prompt: str | list[int] | None,
    messages: list[dict[str, str]] | None,
    *,
    model: str = "",
    request_id: str = "",
    timeout_ms: int = 0,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    logprobs: bool = False,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int | None = None,
    allowed_token_ids: list[int] | None = None,
    top_logprobs: int | None = None,
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
    bad_words: list[str] | None = None,
    structured: tuple[str, str] | None = None,
    n: int | None = None,
    prompt_logprobs: int | None = None,
    speculate: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> pb.GenerateRequest:
    """A ``GenerateRequest``; an option left None is left unset (the server's default)."""
    sp = pb.SamplingParams(
        stop=stop or [],
        stop_token_ids=stop_token_ids or [],
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=include_stop_str_in_output,
        keep_special_tokens=not skip_special_tokens,
        bad_words=bad_words or [],
    )
    if structured is not None:  # (kind, spec): ("json_schema", schema as JSON text), ("regex", ...), ...
        sp.structured.kind, sp.structured.spec = structured
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_k", top_k),
        ("top_p", top_p),
        ("seed", seed),
        ("min_p", min_p),
        ("repetition_penalty", repetition_penalty),
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
        ("min_tokens", min_tokens),
        ("top_logprobs", top_logprobs),
        ("n", n),
        ("prompt_logprobs", prompt_logprobs),
        ("speculate", speculate),
    ):
        if value is not None:
            try:
                setattr(sp, name, value)
            except (ValueError, TypeError) as e:  # e.g. a negative value for an unsigned field
                raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"{name}={value!r}: {e}") from None
    try:
        sp.logit_bias.update(logit_bias or {})
        sp.allowed_token_ids.extend(allowed_token_ids or [])
    except (ValueError, TypeError) as e:
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"token ids: {e}") from None
    req = pb.GenerateRequest(model=model, sampling=sp, request_id=request_id, timeout_ms=timeout_ms)
    if messages is not None:
        req.messages.messages.extend(_message(m) for m in messages)
    chat = (tools, tool_choice, chat_template, chat_template_kwargs)
    if any(v is not None for v in chat) or not parallel_tool_calls:
        req.chat.tools_json = json.dumps(tools) if tools is not None else ""
        req.chat.tool_choice_json = json.dumps(tool_choice) if tool_choice is not None else ""
        req.chat.single_tool_call = not parallel_tool_calls
        req.chat.chat_template = chat_template or ""
        req.chat.chat_template_kwargs_json = json.dumps(chat_template_kwargs) if chat_template_kwargs else ""
    elif isinstance(prompt, str):
        req.prompt = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    return req
