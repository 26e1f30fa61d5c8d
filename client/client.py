"""The gRPC client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

::

    with Client("127.0.0.1:50051") as c:
        print(c.generate("What is the capital of France?", max_tokens=32).text)
        for item in c.stream(messages=[{"role": "user", "content": "Hi"}]):
            ...  # Chunk(token_ids, text, ...) items, then one Final

Errors arrive as typed exceptions (``splitserve.client.errors``). A call that
fails with ``UNAVAILABLE`` before the server sent anything is retried with
exponential backoff (``retries`` times); once tokens have arrived it is not,
so no token is ever delivered twice. Leaving a ``stream`` early cancels the
request on the server, which frees its KV everywhere. ``timeout`` (seconds)
is the call's deadline, retries included: each attempt gets what is left of it,
and no retry starts after it. A request with ``timeout_ms`` (the server's deadline
for it) and no call ``timeout`` gets a client-side deadline ``DEADLINE_GRACE_S``
past it (or the client's ``timeout``, if sooner): no call outlives its deadline,
even if the server never answers.
``api_key`` (default: the ``SPLITSERVE_API_KEY`` environment variable) is sent
as ``authorization: Bearer KEY`` on every call; a server that wants one and does
not get it raises ``Unauthenticated``.

``target`` may name several routers (``Client(["10.0.0.1:50051", "10.0.0.2:50051"])``,
or a DNS name with several addresses, ``"dns:///routers.example:50051"``): calls go
round-robin over those that are up (gRPC's own ``round_robin`` policy), and the
retry of a call that failed before its first response goes to the next one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client.errors import Unavailable, from_rpc_error
from splitserve.client.types import Chunk, Completion, Final, build_request, collect, item_of
from splitserve.proto import splitserve_pb2 as pb
from splitserve.proto import splitserve_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
API_KEY_ENV = "SPLITSERVE_API_KEY"


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int
    vocab_size: int


DEADLINE_GRACE_S = 2.0  # past a request's timeout_ms, for the server's own answer to arrive


def _call_timeout(timeout: float | None, timeout_ms: int) -> float | None:
    """A call's deadline in seconds without one of its own: the client's ``timeout``,
    bounded by ``timeout_ms`` (the server's deadline for the request; 0: none) plus
    ``DEADLINE_GRACE_S``."""
    if not timeout_ms:
        return timeout
    bound = timeout_ms / 1000 + DEADLINE_GRACE_S
    return bound if timeout is None else min(timeout, bound)


class _Attempts:
    """The attempts of one call: up to ``retries`` + 1, all within ``timeout`` seconds
    from the first (None: no deadline)."""

    def __init__(self, retries: int, backoff_s: float, timeout: float | None):
        self.retries, self.backoff_s = retries, backoff_s
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.made = 0

    def begin(self) -> float | None:
        """Start an attempt; returns its gRPC timeout: what is left of the call's."""
        self.made += 1
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def pause(self, err: Exception) -> float | None:
        """Seconds to wait before retrying after ``err``; None: raise it (not UNAVAILABLE,
        no retry left, or the deadline would pass first)."""
        if not isinstance(err, Unavailable) or self.made > self.retries:
            return None
        wait = self.backoff_s * 2 ** (self.made - 1)
        if self.deadline is not None and time.monotonic() + wait >= self.deadline:
            return None
        return wait


# Each client holds connections of its own (gRPC would share one between every channel to
# the same address in a process): several clients then spread over the routers that
# serve one port (router.replicas), as clients in several processes do. Calls go
# round-robin over the addresses the target resolves to.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.lb_policy_name", "round_robin")]


def _resolve(host: str, port: int) -> tuple:
    """``host``'s first address, IPv4 if it has one (getaddrinfo's own order varies)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0]
        except socket.gaierror:
            continue
    raise ValueError(f"cannot resolve the router address {host!r}")


def channel_target(target: str | Sequence[str]) -> str:
    """One gRPC target for ``target``: as it is if a string; several ``host:port`` as one
    static list (``ipv4:``/``ipv6:``, host names resolved now)."""
    if isinstance(target, str):
        return target
    if not target:
        raise ValueError("the client needs at least one router address")
    resolved = []
    for address in target:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{address!r} is not host:port")
        host = host.strip("[]")
        family, *_, sockaddr = _resolve(host, int(port))
        resolved.append(
            (family, f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}")
        )
    families = {f for f, _ in resolved}
    if len(families) > 1:
        raise ValueError("the router addresses mix IPv4 and IPv6: give one kind")
    scheme = "ipv6" if families == {socket.AF_INET6} else "ipv4"
    return f"{scheme}:" + ",".join(a for _, a in resolved)


def _credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata carrying the API key (``api_key``, else ``SPLITSERVE_API_KEY``)."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return (("authorization", f"Bearer {key}"),) if key else None


def _tokenize_request(prompt: str | None, messages: list[dict[str, str]] | None, model: str):
    req = pb.TokenizeRequest(model=model)
    if messages is not None:
        req.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    elif prompt is not None:
        req.prompt = prompt
    return req


class Client:
    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout: float | None = None,
        retries: int = 3,
        backoff_s: float = 0.2,
        api_key: str | None = None,
    ):
        creds = _credentials(tls, root_certificates)
        self._channel = (
            grpc.secure_channel(channel_target(target), creds, CHANNEL_OPTIONS)
            if creds is not None
            else grpc.insecure_channel(channel_target(target), CHANNEL_OPTIONS)
        )
        self._metadata = _auth_metadata(api_key)
        self._stub = pb_grpc.SplitserveStub(self._channel)
        self.target, self.timeout, self.retries, self.backoff_s = target, timeout, retries, backoff_s

    # ---- generation -------------------------------------------------------------------
    def stream(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        timeout: float | None = None,
        **options: Any,
    ) -> Iterator[Chunk | Final]:
        """Yield ``Chunk`` items as tokens arrive, then one ``Final``. ``options``:
        model, request_id, max_tokens, temperature, top_k, top_p, seed, stop,
        stop_token_ids, ignore_eos, logprobs, top_logprobs, min_p, repetition_penalty, frequency_penalty,
        presence_penalty, logit_bias, min_tokens, allowed_token_ids, include_stop_str_in_output,
        skip_special_tokens, bad_words, structured ((kind, spec), as ``StructuredOutput``),
        n (items carry their sequence's ``index``), prompt_logprobs, tools, tool_choice,
        parallel_tool_calls, chat_template, chat_template_kwargs (with ``messages``; the calls
        read from the output come in ``Final.tool_calls``), timeout_ms (``build_request``)."""
        request = build_request(prompt, messages, **options)
        attempts = self._attempts(timeout, request.timeout_ms)
        while True:
            call = self._stub.Generate(request, timeout=attempts.begin(), metadata=self._metadata)
            received = False
            try:
                for resp in call:
                    received = True
                    yield item_of(resp)
                return
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if not received and (pause := attempts.pause(err)) is not None:
                    time.sleep(pause)
                    continue
                raise err from None
            finally:
                call.cancel()  # a no-op after completion; frees the request if the caller left early

    def generate(self, prompt: str | list[int] | None = None, **kwargs: Any) -> Completion:
        """The whole completion (``stream`` collected); for ``n`` > 1, ``generate_n``."""
        if (kwargs.get("n") or 1) != 1:
            raise ValueError("n > 1 gives several completions: call generate_n")
        (out,) = self.generate_n(prompt, **kwargs)
        return out

    def generate_n(self, prompt: str | list[int] | None = None, **kwargs: Any) -> list[Completion]:
        """The ``n`` (an option, default 1) completions of one request, by index."""
        return collect(kwargs.get("request_id", ""), self.stream(prompt, **kwargs), kwargs.get("n") or 1)

    # ---- other calls --------------------------------------------------------------------
    def tokenize(
        self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None, model: str = ""
    ) -> list[int]:
        resp = self._unary(self._stub.Tokenize, _tokenize_request(prompt, messages, model))
        return list(resp.token_ids)

    def detokenize(self, token_ids: list[int], *, model: str = "") -> str:
        return self._unary(self._stub.Detokenize, pb.DetokenizeRequest(model=model, token_ids=token_ids)).text

    def list_models(self) -> list[ModelInfo]:
        resp = self._unary(self._stub.ListModels, pb.ListModelsRequest())
        return [ModelInfo(m.id, m.max_model_len, m.vocab_size) for m in resp.models]

    def cluster_status(self, traces: int = 0) -> pb.ClusterStatusResponse:
        """Pools, workers and counters; with the latest ``traces`` request traces."""
        return self._unary(self._stub.ClusterStatus, pb.ClusterStatusRequest(traces=traces))

    def upgrade(self, config_yaml: str = "", model: str = "", pace: int = 1) -> pb.UpgradeResponse:
        """Replace every worker, ``pace`` per pool at a time, by one of the new config or model."""
        return self._unary(
            self._stub.Upgrade, pb.UpgradeRequest(config_yaml=config_yaml, model=model, pace=pace)
        )

    def drain(self, worker_id: str, by: str = "kv", timeout_s: float = 0.0) -> pb.DrainResponse:
        """Stop routing to a decode worker and move its running requests to the others."""
        return self._unary(self._stub.Drain, pb.DrainRequest(worker_id=worker_id, by=by, timeout_s=timeout_s))

    def health(self, timeout: float = 2.0) -> bool:
        """True when the server answers SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def _unary(self, method, request):
        attempts = self._attempts(None)
        while True:
            try:
                return method(request, timeout=attempts.begin(), metadata=self._metadata)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if (pause := attempts.pause(err)) is not None:
                    time.sleep(pause)
                    continue
                raise err from None

    def _attempts(self, timeout: float | None, timeout_ms: int = 0) -> _Attempts:
        timeout = timeout if timeout is not None else _call_timeout(self.timeout, timeout_ms)
        return _Attempts(self.retries, self.backoff_s, timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """``Client``'s asyncio twin (same arguments, same semantics)."""

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout: float | None = None,
        retries: int = 3,
        backoff_s: float = 0.2,
        api_key: str | None = None,
    ):
        creds = _credentials(tls, root_certificates)
        self._channel = (
            grpc.aio.secure_channel(channel_target(target), creds, CHANNEL_OPTIONS)
            if creds is not None
            else grpc.aio.insecure_channel(channel_target(target), CHANNEL_OPTIONS)
        )
        self._metadata = _auth_metadata(api_key)
        self._stub = pb_grpc.SplitserveStub(self._channel)
        self.target, self.timeout, self.retries, self.backoff_s = target, timeout, retries, backoff_s

    async def stream(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        timeout: float | None = None,
        **options: Any,
    ) -> AsyncIterator[Chunk | Final]:
        request = build_request(prompt, messages, **options)
        attempts = self._attempts(timeout, request.timeout_ms)
        while True:
            call = self._stub.Generate(request, timeout=attempts.begin(), metadata=self._metadata)
            received = False
            try:
                async for resp in call:
                    received = True
                    yield item_of(resp)
                return
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if not received and (pause := attempts.pause(err)) is not None:
                    await asyncio.sleep(pause)
                    continue
                raise err from None
            finally:
                call.cancel()

    async def generate(self, prompt: str | list[int] | None = None, **kwargs: Any) -> Completion:
        if (kwargs.get("n") or 1) != 1:
            raise ValueError("n > 1 gives several completions: call generate_n")
        (out,) = await self.generate_n(prompt, **kwargs)
        return out

    async def generate_n(self, prompt: str | list[int] | None = None, **kwargs: Any) -> list[Completion]:
        items = [item async for item in self.stream(prompt, **kwargs)]
        return collect(kwargs.get("request_id", ""), items, kwargs.get("n") or 1)

    async def tokenize(
        self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None, model: str = ""
    ) -> list[int]:
        resp = await self._unary(self._stub.Tokenize, _tokenize_request(prompt, messages, model))
        return list(resp.token_ids)

    async def detokenize(self, token_ids: list[int], *, model: str = "") -> str:
        request = pb.DetokenizeRequest(model=model, token_ids=token_ids)
        return (await self._unary(self._stub.Detokenize, request)).text

    async def list_models(self) -> list[ModelInfo]:
        resp = await self._unary(self._stub.ListModels, pb.ListModelsRequest())
        return [ModelInfo(m.id, m.max_model_len, m.vocab_size) for m in resp.models]

    async def cluster_status(self, traces: int = 0) -> pb.ClusterStatusResponse:
        """Pools, workers and counters; with the latest ``traces`` request traces."""
        return await self._unary(self._stub.ClusterStatus, pb.ClusterStatusRequest(traces=traces))

    async def upgrade(self, config_yaml: str = "", model: str = "", pace: int = 1) -> pb.UpgradeResponse:
        """Replace every worker, ``pace`` per pool at a time, by one of the new config or model."""
        request = pb.UpgradeRequest(config_yaml=config_yaml, model=model, pace=pace)
        return await self._unary(self._stub.Upgrade, request)

    async def drain(self, worker_id: str, by: str = "kv", timeout_s: float = 0.0) -> pb.DrainResponse:
        """Stop routing to a decode worker and move its running requests to the others."""
        request = pb.DrainRequest(worker_id=worker_id, by=by, timeout_s=timeout_s)
        return await self._unary(self._stub.Drain, request)

    async def _unary(self, method, request):
        attempts = self._attempts(None)
        while True:
            try:
                return await method(request, timeout=attempts.begin(), metadata=self._metadata)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if (pause := attempts.pause(err)) is not None:
                    await asyncio.sleep(pause)
                    continue
                raise err from None

    def _attempts(self, timeout: float | None, timeout_ms: int = 0) -> _Attempts:
        timeout = timeout if timeout is not None else _call_timeout(self.timeout, timeout_ms)
        return _Attempts(self.retries, self.backoff_s, timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
