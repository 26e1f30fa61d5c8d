"""An OpenAI-compatible HTTP endpoint over the router's ``Dispatcher``.

    POST /v1/chat/completions   messages -> chat template (stream: SSE chunks)
    POST /v1/completions        a prompt (text or token ids) or a list of them (stream: one prompt)
    GET  /v1/models             the served model and its max_model_len
    POST /tokenize, /detokenize vLLM's: token ids of a prompt or messages; text of token ids
    GET  /version
    GET  /health                503 while a pool has no routable worker
    GET  /metrics               Prometheus metrics (router.metrics), when given

With API keys (``router.auth``), ``/v1/...``, ``/tokenize`` and ``/detokenize``
answer 401 without a valid ``Authorization: Bearer KEY``; the rest stays open.

Requests take the same path as gRPC ``Generate`` (same validation, defaults,
admission, cancellation: a client that disconnects aborts its request on every
worker). Errors use OpenAI's shape, ``{"error": {"message", "type", "code"}}``,
with the HTTP status from ``router.errors.http_status_for``. Every field of a
body is checked against ``api_schema`` (the request models are in
``openai_requests``): what splitserve does not honour is refused with a 400
naming it, never silently ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import ssl
import time
import uuid
from importlib.metadata import version
from typing import Any

from aiohttp import web

from splitserve.router.api_schema import check, refusal
from splitserve.router.auth import ApiKeys, http_auth_middleware
from splitserve.router.dispatch import Dispatcher
from splitserve.router.errors import http_status_for
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.metrics import RouterMetrics
from splitserve.router.metrics_server import add_metrics_route
from splitserve.router.openai_logprobs import LogprobsWriter, vllm_prompt_logprobs
from splitserve.router.openai_requests import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIRequest,
    StreamOptions,
    TokenizeRequest,
    json_object,
    text_of,
    validated,
)
from splitserve.router.tools import (
    OutputFormat,
    OutputStream,
    ReasoningParser,
    ToolParser,
    parse,
    template_messages,
)
from splitserve.wire.errors import InvalidRequest

log = logging.getLogger(__name__)


class OpenAIServer:
    """The HTTP front door; with ``api_keys``, ``/v1/...`` needs ``Authorization: Bearer KEY``
    (``router.auth``); with ``ssl_context``, it speaks HTTPS."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        host: str,
        port: int,
        metrics: RouterMetrics | None = None,
        api_keys: ApiKeys | None = None,
        ssl_context: ssl.SSLContext | None = None,
        ignore_unknown_fields: bool = False,
        tool_parser: ToolParser = "hermes",
        reasoning_parser: ReasoningParser | None = None,
    ):
        self.dispatcher = dispatcher
        self.ignore_unknown_fields = ignore_unknown_fields
        self.tool_parser = tool_parser  # how "auto" tool calls are read from chat output
        self.reasoning_parser = reasoning_parser
        self.metrics = metrics
        self.api_keys = api_keys
        self.ssl_context = ssl_context
        self.host, self.port = host, port
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        middlewares = []
        if self.api_keys is not None:
            middlewares.append(http_auth_middleware(self.api_keys, _auth_error_body))
        app = web.Application(middlewares=middlewares)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/version", self._version)
        app.router.add_get("/health", self._health)
        if self.metrics is not None:
            add_metrics_route(app, self.metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the bound port, also when 0 was asked for
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- handlers -------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        missing = [role.value for role in self.dispatcher.unroutable_roles()]
        if missing:
            message = f"no routable worker in the {' and '.join(missing)} pool"
            return web.json_response({"status": "unavailable", "message": message}, status=503)
        return web.json_response({"status": "ok"})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": version("splitserve")})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: ``{prompt}`` or ``{messages}`` -> the token ids Generate
        would run (the chat template applied to messages)."""
        try:
            body = validated(TokenizeRequest, json_object(await request.read()))
            self.dispatcher.check_model(body.model)
            messages = None if body.messages is None else template_messages(body.messages, text_of)
            ids = self.dispatcher.validator.encode(body.prompt, messages)
            limit = self.dispatcher.validator.max_model_len
            return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": limit})
        except Exception as e:
            return _error(e)

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: ``{tokens}`` -> their text."""
        try:
            body = validated(DetokenizeRequest, json_object(await request.read()))
            self.dispatcher.check_model(body.model)
            return web.json_response({"prompt": self.dispatcher.validator.decode(body.tokens)})
        except Exception as e:
            return _error(e)

    async def _models(self, request: web.Request) -> web.Response:
        name = self.dispatcher.served_model
        model = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "splitserve",
            "max_model_len": self.dispatcher.validator.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, ChatRequest, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CompletionRequest, chat=False)

    async def _serve(self, request: web.Request, cls: type[OpenAIRequest], chat: bool) -> web.StreamResponse:
        try:
            body = self._parse(await request.read(), cls)
            rid = body.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            fmt = None
            if chat:
                fmt = body.output_format(self.tool_parser, self.reasoning_parser)
                messages, templating = body.template_messages(), body.templating()
                inputs = [GenerateInput(body.params(), messages=messages, templating=templating)]
            else:
                inputs = [GenerateInput(body.params(), prompt=p) for p in body.prompts()]
            inputs = [
                dataclasses.replace(
                    inp,
                    model=body.model,
                    unset=body.unset(),
                    request_id=rid if len(inputs) == 1 else f"{rid}-{i}",
                )
                for i, inp in enumerate(inputs)
            ]
            if body.stream:
                if len(inputs) > 1:
                    raise InvalidRequest("a streamed completion takes one prompt, not a list of them")
                events = self.dispatcher.generate(inputs[0])
                return await self._stream(request, inputs[0], events, fmt, body)
            # several prompts (completions): one choice each, run side by side
            try:
                async with asyncio.TaskGroup() as group:  # one failing cancels the others
                    tasks = [
                        group.create_task(self._choices(inp, fmt, body, i * inp.params.n))
                        for i, inp in enumerate(inputs)
                    ]
            except ExceptionGroup as failed:  # the client hears of the first failure
                raise failed.exceptions[0] from None
            done = [task.result() for task in tasks]
            choices = [c for cs, _ in done for c in cs]
            usage = _usage([f for _, finals in done for f in finals])
            return web.json_response(self._envelope(rid, chat, False) | {"choices": choices, "usage": usage})
        except Exception as e:
            return _error(e)

    def _parse(self, raw: bytes, cls: type[OpenAIRequest]) -> OpenAIRequest:
        """The body as ``cls``; ``InvalidRequest`` naming every refused field, and every
        unknown one unless those are ignored (then each is logged and counted)."""
        fields = json_object(raw)
        body = validated(cls, fields)
        verdict = check(cls.ENDPOINT, fields, cls.model_fields)
        if verdict.unknown and self.ignore_unknown_fields:
            for name in verdict.unknown:
                log.warning("ignored the unknown field %r of a request to %s", name, cls.ENDPOINT.value)
                if self.metrics is not None:
                    self.metrics.ignored_fields.inc()
            verdict = dataclasses.replace(verdict, unknown=())
        message = refusal(cls.ENDPOINT, verdict)
        if message is not None:
            raise InvalidRequest(message)
        return body

    async def _choices(
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
        for i, (part, final) in enumerate(zip(parts, finals)):
            content = "".join(part.text)
            reason = final.finish_reason.value
            writer = self._logprobs(chat)
            echoed = self._echo(body, inp.prompt, writer, part.prompt_logprobs)
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
            if body.prompt_logprobs is not None and part.prompt_logprobs is not None:
                validator = self.dispatcher.validator
                ids = validator.encode(inp.prompt, inp.messages, inp.templating)
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    ids, part.prompt_logprobs, validator.token_text
                )
            choices.append(choice)
        return choices, finals

    async def _stream(
        self, request, inp: GenerateInput, events, fmt: OutputFormat | None, body: OpenAIRequest
    ):
        """A request's choices as server-sent chunks; chat (``fmt``) has its text read as
        content, reasoning and tool calls as it comes (``router.tools.OutputStream``)."""
        # The first event may be an error (validation, admission): answer it as JSON, not SSE.
        first = await events.__anext__()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chat = fmt is not None
        env = self._envelope(inp.request_id, chat, True)
        options = body.stream_options or StreamOptions()
        n = inp.params.n
        # per choice: its logprobs writer (completions' text_offset runs on), the prompt to
        # echo, its output as read so far
        writers = [self._logprobs(chat) if inp.params.logprobs else None for _ in range(n)]
        echo_pending = [True] * n
        outputs = [OutputStream(fmt) for _ in range(n)] if chat else []
        finals: list[FinalEvent] = []
        completion_tokens = 0

        async def send(obj: dict) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        def chunk(choice: dict, prompt_tokens: int) -> dict:
            out = env | {"choices": [choice]}
            if options.continuous_usage_stats:
                out["usage"] = _counts(prompt_tokens, completion_tokens)
            return out

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
                    if echo_pending[i]:  # the prompt goes before the first tokens
                        echoed = self._echo(
                            body, inp.prompt, writer or self._logprobs(chat), ev.prompt_logprobs
                        )
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
                            await send(chunk(choice | {"finish_reason": None}, ev.prompt_tokens))
                    elif text or options.continuous_usage_stats or writer is not None:
                        choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": None}
                        await send(chunk(choice, ev.prompt_tokens))
                else:  # a FinalEvent
                    finals.append(ev)
                    reason = ev.finish_reason.value
                    if chat:
                        rest, called = outputs[i].finish()
                        for delta in rest:
                            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                            await send(chunk(choice, ev.prompt_tokens))
                        reason = _calls_reason(reason, fmt) if called else reason
                    choice = {"index": i, "finish_reason": reason}
                    choice |= {"delta": {}} if chat else {"text": "", "logprobs": None}
                    await send(chunk(choice, ev.prompt_tokens))
                    if len(finals) == n:
                        if options.include_usage:
                            await send(env | {"choices": [], "usage": _usage(finals)})
                        break
                ev = await events.__anext__()
        except Exception as e:  # mid-stream: the status is already sent; report in-band
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

    def _envelope(self, request_id: str, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {
            "id": request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.dispatcher.served_model,
        }


def _calls_reason(reason: str, fmt: OutputFormat) -> str:
    """A choice that called tools ends with ``tool_calls`` (a forced named call, and one
    cut short by ``length``, keep theirs, as OpenAI's)."""
    return "tool_calls" if reason == "stop" and fmt.choice.mode != "named" else reason


def _counts(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def _usage(finals: list[FinalEvent]) -> dict[str, Any]:
    """The usage of one request, or the sum of several (a list of prompts): each
    prompt counted once (its first choice's), every choice's completion tokens."""
    firsts = [f for f in finals if f.index == 0]
    usage: dict[str, Any] = _counts(
        sum(f.prompt_tokens for f in firsts), sum(f.completion_tokens for f in finals)
    )
    return usage | {"prompt_tokens_details": {"cached_tokens": sum(f.cached_prompt_tokens for f in firsts)}}


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


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """HTTPS with this PEM certificate chain and key (the files gRPC's TLS uses too)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


def _auth_error_body(message: str) -> dict:
    """A 401 as OpenAI sends it (its SDK raises ``AuthenticationError``)."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}}


def _error(exc: BaseException) -> web.Response:
    status, kind, message = http_status_for(exc)
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
