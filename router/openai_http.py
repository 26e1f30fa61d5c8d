"""An OpenAI-compatible HTTP endpoint over the router's ``Dispatcher``.

    POST /v1/chat/completions   messages -> chat template (stream: SSE chunks)
    POST /v1/completions        prompt as text or token ids (stream: SSE chunks)
    GET  /v1/models
    GET  /health
    GET  /metrics               Prometheus metrics (router.metrics), when given

With API keys (``router.auth``), ``/v1/...`` answers 401 without a valid
``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open.

Requests take the same path as gRPC ``Generate`` (same validation, admission,
cancellation: a client that disconnects aborts its request on every worker).
Errors use OpenAI's shape, ``{"error": {"message", "type", "code"}}``, with
the HTTP status from ``router.errors.http_status_for``. Fields OpenAI defines
that splitserve does not implement (``n`` > 1, penalties, ``logit_bias``,
tools) are refused with 400 rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import ssl
import time
import uuid
from importlib.metadata import version
from typing import Any, ClassVar, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitserve.router.api_schema import Endpoint, check, refusal
from splitserve.router.auth import ApiKeys, http_auth_middleware
from splitserve.router.dispatch import Dispatcher
from splitserve.router.errors import http_status_for
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.metrics import RouterMetrics
from splitserve.router.metrics_server import add_metrics_route
from splitserve.router.openai_logprobs import LogprobsWriter
from splitserve.wire.defaults import DEFAULTED, SAMPLING_FIELDS
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import SamplingParams, StructuredOutput

log = logging.getLogger(__name__)


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


class _Request(BaseModel):
    """The fields a front door reads (``api_schema``: honoured); every other field of
    the body is checked against ``api_schema.FIELDS``."""

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
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

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
        )

    def unset(self) -> frozenset[str]:
        return frozenset(DEFAULTED) - self._given().keys()


class ChatRequest(_Request):
    ENDPOINT = Endpoint.CHAT

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0


class CompletionRequest(_Request):
    ENDPOINT = Endpoint.COMPLETIONS

    prompt: str | list[int]
    logprobs: int | None = None  # the chosen token's and this many most likely tokens'

    def requested_logprobs(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    tokens: list[int]


def _text_of(content: Any) -> str:
    """Message content as text: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    raise InvalidRequest("message content must be text (a string or text parts)")


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
    ):
        self.dispatcher = dispatcher
        self.ignore_unknown_fields = ignore_unknown_fields
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
            body = _validated(TokenizeRequest, _json_object(await request.read()))
            self.dispatcher.check_model(body.model)
            messages = None
            if body.messages is not None:
                messages = [
                    {"role": str(m.get("role", "")), "content": _text_of(m.get("content"))}
                    for m in body.messages
                ]
            ids = self.dispatcher.validator.encode(body.prompt, messages)
            limit = self.dispatcher.validator.max_model_len
            return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": limit})
        except Exception as e:
            return _error(e)

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: ``{tokens}`` -> their text."""
        try:
            body = _validated(DetokenizeRequest, _json_object(await request.read()))
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

    async def _serve(self, request: web.Request, cls: type[_Request], chat: bool) -> web.StreamResponse:
        try:
            body = self._parse(await request.read(), cls)
            if chat:
                messages = [
                    {"role": str(m.get("role", "")), "content": _text_of(m.get("content"))}
                    for m in body.messages
                ]
                inp = GenerateInput(body.params(), messages=messages, model=body.model, unset=body.unset())
            else:
                inp = GenerateInput(body.params(), prompt=body.prompt, model=body.model, unset=body.unset())
            rid = body.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            inp = dataclasses.replace(inp, request_id=rid)
            events = self.dispatcher.generate(inp)
            if body.stream:
                return await self._stream(request, inp, events, chat, body)
            return await self._collect(inp, events, chat)
        except Exception as e:
            return _error(e)

    def _parse(self, raw: bytes, cls: type[_Request]) -> _Request:
        """The body as ``cls``; ``InvalidRequest`` naming every refused field, and every
        unknown one unless those are ignored (then each is logged and counted)."""
        fields = _json_object(raw)
        body = _validated(cls, fields)
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

    async def _collect(self, inp: GenerateInput, events, chat: bool) -> web.Response:
        text, final = [], None
        token_ids, logprobs, top = [], [], []
        async for ev in events:
            if isinstance(ev, TokenEvent):
                text.append(ev.text)
                token_ids += ev.token_ids
                logprobs += ev.logprobs
                top += ev.top_logprobs
            else:
                final = ev
        content = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": final.finish_reason.value}
        lp = self._logprobs(chat).write(token_ids, logprobs, top) if inp.params.logprobs else None
        if chat:
            choice |= {"message": {"role": "assistant", "content": content}, "logprobs": lp}
        else:
            choice |= {"text": content, "logprobs": lp}
        return web.json_response(
            self._envelope(inp, chat, False) | {"choices": [choice], "usage": _usage(final)}
        )

    async def _stream(self, request, inp: GenerateInput, events, chat: bool, body: _Request):
        # The first event may be an error (validation, admission): answer it as JSON, not SSE.
        first = await events.__anext__()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        env = self._envelope(inp, chat, True)
        options = body.stream_options or StreamOptions()
        writer = self._logprobs(chat) if inp.params.logprobs else None
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
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                await send(env | {"choices": [role]})
            ev = first
            while True:
                if isinstance(ev, TokenEvent):
                    completion_tokens += len(ev.token_ids)
                    if ev.text or options.continuous_usage_stats or writer is not None:
                        lp = writer.write(ev.token_ids, ev.logprobs, ev.top_logprobs) if writer else None
                        part = {"delta": {"content": ev.text}} if chat else {"text": ev.text}
                        choice = {"index": 0, "finish_reason": None, "logprobs": lp} | part
                        await send(chunk(choice, ev.prompt_tokens))
                else:  # the FinalEvent
                    choice = {"index": 0, "finish_reason": ev.finish_reason.value}
                    choice |= {"delta": {}} if chat else {"text": "", "logprobs": None}
                    await send(chunk(choice, ev.prompt_tokens))
                    if options.include_usage:
                        await send(env | {"choices": [], "usage": _usage(ev)})
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

    def _logprobs(self, chat: bool) -> LogprobsWriter:
        return LogprobsWriter(chat, self.dispatcher.validator.token_text)

    def _envelope(self, inp: GenerateInput, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {
            "id": inp.request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.dispatcher.served_model,
        }


def _counts(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def _usage(final: FinalEvent) -> dict[str, Any]:
    usage: dict[str, Any] = _counts(final.prompt_tokens, final.completion_tokens)
    return usage | {"prompt_tokens_details": {"cached_tokens": final.cached_prompt_tokens}}


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        fields = json.loads(raw)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidRequest("the request body is not valid JSON (UTF-8)") from None
    if not isinstance(fields, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return fields


def _validated(cls: type[BaseModel], fields: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(fields)
    except ValidationError as e:
        raise InvalidRequest(_pydantic_message(e)) from None


def _pydantic_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "invalid request: " + "; ".join(parts)


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
