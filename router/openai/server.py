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
body is checked against ``openai.schema`` (the request models are in
``openai.protocol``): what splitserve does not honour is refused with a 400
naming it, never silently ignored. The answers' shapes are ``openai.responses``'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import uuid
from importlib.metadata import version
from typing import Protocol

from aiohttp import web

from splitserve.router.auth import ApiKeys, http_auth_middleware
from splitserve.router.dispatch import Dispatcher
from splitserve.router.errors import http_status_for
from splitserve.router.events import GenerateInput
from splitserve.router.metrics import RouterMetrics
from splitserve.router.metrics_server import add_metrics_route
from splitserve.router.openai.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    OpenAIRequest,
    TokenizeRequest,
    UnloadLoRARequest,
    json_object,
    text_of,
    validated,
)
from splitserve.router.openai.responses import Responses, usage
from splitserve.router.openai.schema import check, refusal
from splitserve.router.tools import (
    ReasoningParser,
    ToolParser,
    template_messages,
)
from splitserve.wire.background import cancelled_by_caller
from splitserve.wire.errors import InvalidRequest

log = logging.getLogger(__name__)


class AdapterAdmin(Protocol):
    """Loads and unloads LoRA adapters on every worker (``cluster.lora_admin.LoRAAdmin``)."""

    async def load(self, name: str, path: str) -> None: ...

    async def unload(self, name: str) -> None: ...


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
        reuse_port: bool = False,
        lora: AdapterAdmin | None = None,
    ):
        """``lora``: loads and unloads LoRA adapters on every worker (the primary router's
        ``LoRAAdmin``; another router's passes the change to it, ``cluster.adapter_desk``;
        None: those calls are answered 501)."""
        self.dispatcher = dispatcher
        self.lora = lora
        self.reuse_port = reuse_port  # other routers listen on this port too (router.replicas)
        self.responses = Responses(dispatcher)
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
        app.router.add_post("/v1/load_lora_adapter", self._load_lora)
        app.router.add_post("/v1/unload_lora_adapter", self._unload_lora)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/version", self._version)
        app.router.add_get("/health", self._health)
        if self.metrics is not None:
            add_metrics_route(app, self.metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.host,
            self.port,
            ssl_context=self.ssl_context,
            reuse_port=self.reuse_port or None,
        )
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
            message = f"no routable worker in the {missing[0]} pool"
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
        adapters = [  # vLLM's listing of LoRA adapters: each with its base model as parent
            {"id": a, "object": "model", "created": 0, "owned_by": "splitserve", "parent": name, "root": name}
            for a in self.dispatcher.adapters
        ]
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def _load_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA loading: ``{lora_name, lora_path}``; the adapter serves the
        next request on every worker (``cluster.lora_admin``)."""
        if self.lora is None:
            return _no_pools()
        try:
            body = validated(LoadLoRARequest, json_object(await request.read()))
            await asyncio.shield(self.lora.load(body.lora_name, body.lora_path))  # done once begun
        except Exception as e:
            return _error(e)
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA unloading: ``{lora_name}``; 404 for an adapter not served."""
        if self.lora is None:
            return _no_pools()
        try:
            body = validated(UnloadLoRARequest, json_object(await request.read()))
            await asyncio.shield(self.lora.unload(body.lora_name))
        except Exception as e:
            return _error(e)
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

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
                params = body.params()
                if fmt.keeps_special_tokens:  # harmony's markers are special tokens
                    params = dataclasses.replace(params, skip_special_tokens=False)
                inputs = [GenerateInput(params, messages=messages, templating=templating)]
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
                return await self.responses.stream(request, inputs[0], events, fmt, body)
            # several prompts (completions): one choice each, run side by side
            try:
                async with asyncio.TaskGroup() as group:  # one failing cancels the others
                    tasks = [
                        group.create_task(self.responses.choices(inp, fmt, body, i * inp.params.n))
                        for i, inp in enumerate(inputs)
                    ]
            except ExceptionGroup as failed:  # the client hears of the first failure
                raise failed.exceptions[0] from None
            done = [task.result() for task in tasks]
            choices = [c for cs, _ in done for c in cs]
            counts = usage([f for _, finals in done for f in finals])
            return web.json_response(
                self.responses.envelope(rid, chat, False, body.model) | {"choices": choices, "usage": counts}
            )
        except (Exception, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError) and cancelled_by_caller():
                raise  # the client left: nobody to answer
            return _error(e)  # a stray cancellation too: an answer, never a dropped connection

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


def _no_pools() -> web.Response:
    message = "this router runs no pools: load and unload LoRA adapters on the cluster's first router"
    return web.json_response(
        {"error": {"message": message, "type": "unimplemented", "code": 501}}, status=501
    )
