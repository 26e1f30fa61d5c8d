"""A request's answer in OpenAI's shapes: its choices whole (``Responses.choices``),
or as server-sent chunks while it runs (``Responses.stream``). Chat output is read
as content, reasoning and tool calls (``router.tools``); completions' ``echo``
puts the prompt first; logprobs take OpenAI's shapes (``router.openai.logprobs``)
and vLLM's ``prompt_logprobs`` its own."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

from aiohttp import web

from splitserve.router.dispatch import Dispatcher
from splitserve.router.errors import http_status_for
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.openai.logprobs import LogprobsWriter, vllm_prompt_logprobs
from splitserve.router.openai.protocol import OpenAIRequest, StreamOptions
from splitserve.router.tools import OutputFormat, OutputStream, parse
from splitserve.wire.background import cancelled_by_caller


class Responses:
    """Builds the answers of the requests ``dispatcher`` runs."""

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher

    async def choices(
        self, inp: GenerateInput, fmt: OutputFormat | None, body: OpenAIRequest, first: int
    ) -> tuple[list[dict[str, Any]], list[FinalEvent]]:
        """One request (one prompt) run to its end: its ``n`` choices, at indexes
        ``first``.. , and how each ended; chat (``fmt``) reads tool calls and reasoning."""
        chat, n = fmt is not None, inp.params.n
        parts = [_Choice() for _ in range(n)]
        finals: list[FinalEvent | None] = [None] * n
        async for ev in self.dispatcher.generate(inp):
            if isinstance(ev, TokenEvent):
                parts[ev.index].add(ev)
            else:
                finals[ev.index] = ev
        choices = []
        prompt_lp = parts[0].prompt_logprobs  # the first sequence's: the prompt is every choice's
        for i, (part, final) in enumerate(zip(parts, finals)):
            content = "".join(part.text)
            reason = final.finish_reason.value
            writer = self._logprobs(chat)
            echoed = self._echo(body, inp.prompt, writer, prompt_lp)
            lp = writer.write(part.token_ids, part.logprobs, part.top) if inp.params.logprobs else None
            if echoed is not None:
                content = echoed[0] + content
                if lp is not None and echoed[1] is not None:
                    lp = writer.join(echoed[1], lp)
            if chat:
                parsed = parse(content, fmt)
                message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
                if parsed.calls:
                    message["tool_calls"] = [c.message() for c in parsed.calls]
                    reason = _calls_reason(reason, fmt)
                elif message["content"] is None:
                    message["content"] = ""
                if fmt.reasoning:
                    message["reasoning_content"] = parsed.reasoning or None
                choice = {"index": first + i, "message": message, "logprobs": lp, "finish_reason": reason}
            else:
                choice = {"index": first + i, "text": content, "logprobs": lp, "finish_reason": reason}
            choices.append(choice)
        if body.prompt_logprobs is not None and prompt_lp is not None:
            validator = self.dispatcher.validator
            ids = validator.encode(inp.prompt, inp.messages, inp.templating)
            shown = vllm_prompt_logprobs(ids, prompt_lp, validator.token_text)
            for choice in choices:
                choice["prompt_logprobs"] = shown
        return choices, finals

    async def stream(
        self, request, inp: GenerateInput, events, fmt: OutputFormat | None, body: OpenAIRequest
    ):
        """A request's choices as server-sent chunks; chat (``fmt``) has its text read as
        content, reasoning and tool calls as it comes (``router.tools.OutputStream``)."""
        # The first event may be an error (validation, admission): answer it as JSON, not SSE.
        first = await events.__anext__()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chat = fmt is not None
        env = self.envelope(inp.request_id, chat, True, inp.model)
        options = body.stream_options or StreamOptions()
        n = inp.params.n
        # per choice: its logprobs writer (completions' text_offset runs on), the prompt to
        # echo, its output as read so far
        writers = [self._logprobs(chat) if inp.params.logprobs else None for _ in range(n)]
        echo_pending = [True] * n
        prompt_lp = None  # the prompt's logprobs, from the first sequence (the forks start after it)
        outputs = [OutputStream(fmt) for _ in range(n)] if chat else []
        finals: list[FinalEvent] = []
        completion_tokens = 0

        async def send(obj: dict) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        head = json.dumps(env)[:-1]  # the envelope, serialised once: '{"id": ..., "model": ...'

        async def send_chunk(choice: dict, prompt_tokens: int) -> None:
            """``send(env | {"choices": [choice]} (| {"usage": ...}))``, the same bytes at
            the cost of serialising ``choice`` alone: this runs once per token."""
            usage = ""
            if options.continuous_usage_stats:
                usage = f', "usage": {json.dumps(_counts(prompt_tokens, completion_tokens))}'
            await resp.write(f'data: {head}, "choices": [{json.dumps(choice)}]{usage}}}\n\n'.encode())

        try:
            if chat:
                for i in range(n):
                    role = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    await send(env | {"choices": [role]})
            ev = first
            while True:
                i, writer = ev.index, writers[ev.index]
                if isinstance(ev, TokenEvent):
                    completion_tokens += len(ev.token_ids)
                    text, echoed = ev.text, None
                    prompt_lp = prompt_lp or ev.prompt_logprobs
                    if echo_pending[i]:  # the prompt goes before the first tokens
                        echoed = self._echo(body, inp.prompt, writer or self._logprobs(chat), prompt_lp)
                        echo_pending[i] = False
                        text = (echoed[0] if echoed else "") + text
                    lp = writer.write(ev.token_ids, ev.logprobs, ev.top_logprobs) if writer else None
                    if lp is not None and echoed is not None and echoed[1] is not None:
                        lp = writer.join(echoed[1], lp)
                    if chat:
                        deltas = outputs[i].feed(text)
                        if not deltas and (lp is not None or options.continuous_usage_stats):
                            deltas = [{"content": ""}]
                        for k, delta in enumerate(deltas):  # the logprobs go with the first
                            choice = {"index": i, "delta": delta, "logprobs": None if k else lp}
                            await send_chunk(choice | {"finish_reason": None}, ev.prompt_tokens)
                    elif text or options.continuous_usage_stats or writer is not None:
                        choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": None}
                        await send_chunk(choice, ev.prompt_tokens)
                else:  # a FinalEvent
                    finals.append(ev)
                    reason = ev.finish_reason.value
                    if chat:
                        rest, called = outputs[i].finish()
                        for delta in rest:
                            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                            await send_chunk(choice, ev.prompt_tokens)
                        reason = _calls_reason(reason, fmt) if called else reason
                    choice = {"index": i, "finish_reason": reason}
                    choice |= {"delta": {}} if chat else {"text": "", "logprobs": None}
                    await send_chunk(choice, ev.prompt_tokens)
                    if len(finals) == n:
                        if options.include_usage:
                            await send(env | {"choices": [], "usage": usage(finals)})
                        break
                ev = await events.__anext__()
        except (Exception, asyncio.CancelledError) as e:  # mid-stream: the status is sent; in-band
            if isinstance(e, asyncio.CancelledError) and cancelled_by_caller():
                raise  # the client left: nobody to answer
            status, kind, message = http_status_for(e)
            await send({"error": {"message": message, "type": kind, "code": status}})
        finally:
            await events.aclose()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _echo(
        self,
        body: OpenAIRequest,
        prompt: str | list[int],
        writer: LogprobsWriter,
        prompt_logprobs: list | None,
    ) -> tuple[str, dict[str, Any] | None] | None:
        """Completions with ``echo``: ``prompt``'s text and (with logprobs) its logprobs'
        part; None without echo."""
        if not getattr(body, "echo", False):
            return None
        validator = self.dispatcher.validator
        ids = validator.encode(prompt, None)
        if isinstance(prompt, str):
            text = prompt
        elif validator.tokenizer is not None:
            text = validator.decode(ids)
        else:  # no tokenizer: the tokens' names, as the logprobs give them
            text = "".join(validator.token_text(t) for t in ids)
        part = writer.write_prompt(ids, prompt_logprobs) if prompt_logprobs is not None else None
        return text, part

    def _logprobs(self, chat: bool) -> LogprobsWriter:
        return LogprobsWriter(chat, self.dispatcher.validator.token_text)

    def envelope(self, request_id: str, chat: bool, chunk: bool, model: str = "") -> dict[str, Any]:
        """The fields every response (or chunk) of a request starts with; ``model``: the
        name the request gave (an adapter's), else the served model's."""
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {
            "id": request_id,
            "object": kind,
            "created": int(time.time()),
            "model": model or self.dispatcher.served_model,
        }


def _calls_reason(reason: str, fmt: OutputFormat) -> str:
    """A choice that called tools ends with ``tool_calls`` (a forced named call, and one
    cut short by ``length``, keep theirs, as OpenAI's)."""
    return "tool_calls" if reason == "stop" and fmt.choice.mode != "named" else reason


def _counts(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def usage(finals: list[FinalEvent]) -> dict[str, Any]:
    """The usage of one request, or the sum of several (a list of prompts): each
    prompt counted once (its first choice's), every choice's completion tokens."""
    firsts = [f for f in finals if f.index == 0]
    usage: dict[str, Any] = _counts(
        sum(f.prompt_tokens for f in firsts), sum(f.completion_tokens for f in finals)
    )
    usage["prompt_tokens_details"] = {"cached_tokens": sum(f.cached_prompt_tokens for f in firsts)}
    drafted, kept = sum(f.draft_tokens for f in finals), sum(f.accepted_draft_tokens for f in finals)
    if drafted:  # speculative decoding, in OpenAI's fields for predicted tokens
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": kept,
            "rejected_prediction_tokens": drafted - kept,
        }
    return usage


@dataclasses.dataclass
class _Choice:
    """One choice's tokens as they come."""

    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None

    def add(self, ev: TokenEvent) -> None:
        self.text.append(ev.text)
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs
        self.top += ev.top_logprobs
        self.prompt_logprobs = self.prompt_logprobs or ev.prompt_logprobs
