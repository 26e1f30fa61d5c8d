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
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from splitserve.router.auth import ApiKeys, http_auth_middleware
from splitserve.router.dispatch import Dispatcher
from splitserve.router.errors import http_status_for
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.metrics import RouterMetrics
from splitserve.router.metrics_server import add_metrics_route
from splitserve.wire.defaults import SAMPLING_FIELDS
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import DEFAULT_MAX_TOKENS, SamplingParams

log = logging.getLogger(__name__)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension, as in vLLM
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    ignore_eos: bool = False  # an extension, as in vLLM
    user: str | None = None

    def params(self) -> SamplingParams:
        unsupported = [
            k
            for k in ("presence_penalty", "frequency_penalty", "logit_bias", "tools", "functions", "best_of")
            if (self.model_extra or {}).get(k) not in (None, 0, 0.0, {}, [])
        ]
        if self.n != 1:
            unsupported.append("n > 1")
        if unsupported:
            raise InvalidRequest(f"not supported by this server: {', '.join(unsupported)}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
        )

    def unset(self) -> frozenset[str]:
        """Sampling fields this request left unset (the model's defaults apply to them)."""
        return frozenset(f for f in SAMPLING_FIELDS if getattr(self, f) is None)


class ChatRequest(_Request):
    messages: list[dict[str, Any]]


class CompletionRequest(_Request):
    prompt: str | list[int]


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
    ):
        self.dispatcher = dispatcher
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
        return web.json_response({"status": "ok"})

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
            try:
                body = cls.model_validate(json.loads(await request.read()))
            except ValidationError as e:
                raise InvalidRequest(_pydantic_message(e)) from None
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                raise InvalidRequest("the request body is not valid JSON (UTF-8)") from None
            if chat:
                messages = [
                    {"role": str(m.get("role", "")), "content": _text_of(m.get("content"))}
                    for m in body.messages
                ]
                inp = GenerateInput(body.params(), messages=messages, model=body.model, unset=body.unset())
            else:
                inp = GenerateInput(body.params(), prompt=body.prompt, model=body.model, unset=body.unset())
            prefix = "chatcmpl" if chat else "cmpl"
            inp = dataclasses.replace(inp, request_id=f"{prefix}-{uuid.uuid4().hex}")
            events = self.dispatcher.generate(inp)
            if body.stream:
                return await self._stream(request, inp, events, chat, body)
            return await self._collect(inp, events, chat)
        except Exception as e:
            return _error(e)

    async def _collect(self, inp: GenerateInput, events, chat: bool) -> web.Response:
        text, final = [], None
        async for ev in events:
            if isinstance(ev, TokenEvent):
                text.append(ev.text)
            else:
                final = ev
        content = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": final.finish_reason.value}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice |= {"text": content, "logprobs": None}
        return web.json_response(
            self._envelope(inp, chat, False) | {"choices": [choice], "usage": _usage(final)}
        )

    async def _stream(self, request, inp: GenerateInput, events, chat: bool, body: _Request):
        # The first event may be an error (validation, admission): answer it as JSON, not SSE.
        first = await events.__anext__()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        env = self._envelope(inp, chat, True)
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        async def send(obj: dict) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            if chat:
                await send(
                    env
                    | {
                        "choices": [
                            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        ]
                    }
                )
            ev = first
            while True:
                if isinstance(ev, TokenEvent):
                    if ev.text:
                        part = {"content": ev.text} if chat else {}
                        choice = {"index": 0, "finish_reason": None}
                        choice |= {"delta": part} if chat else {"text": ev.text, "logprobs": None}
                        await send(env | {"choices": [choice]})
                else:  # the FinalEvent
                    choice = {"index": 0, "finish_reason": ev.finish_reason.value}
                    choice |= {"delta": {}} if chat else {"text": "", "logprobs": None}
                    await send(env | {"choices": [choice]})
                    if include_usage:
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

    def _envelope(self, inp: GenerateInput, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {
            "id": inp.request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.dispatcher.served_model,
        }


def _usage(final: FinalEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_prompt_tokens},
    }


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
