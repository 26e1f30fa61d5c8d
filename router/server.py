"""The router's gRPC server: the Splitserve service, standard health checking
(``grpc.health.v1``) and server reflection, on one ``grpc.aio`` server.

Health is NOT_SERVING until ``start`` has the workers' first stats, SERVING
while up, and NOT_SERVING again once ``stop`` begins (load balancers drain
first). With ``api_keys``, every call but health checking needs a key
(``router.auth``). A background task refreshes the registry's worker stats every
``stats_interval_s`` and, with a ``relief``, then moves requests off decode
workers whose KV cache is nearly full (``router.moves``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.proto import splitserve_pb2 as pb
from splitserve.proto import splitserve_pb2_grpc as pb_grpc
from splitserve.router.auth import ApiKeys, GrpcAuthInterceptor
from splitserve.router.dispatch import Dispatcher
from splitserve.router.moves import Relief
from splitserve.router.service import MALFORMED, Routers, SplitserveService, Upgrade, malformed
from splitserve.router.tools import ToolParser

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Splitserve"].full_name


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A call to the Splitserve service whose bytes are not the method's message (bad
    wire format, invalid UTF-8 in a string field) ends with ``INVALID_ARGUMENT`` and
    a sentence, where gRPC alone would answer ``INTERNAL``. Its request decodes to
    ``MALFORMED``: unary calls are refused here; ``Generate`` refuses it itself, so
    that no wrapper sits between its stream and gRPC (one more hop per token)."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/") or handler.request_streaming:
            return handler
        decode, method = handler.request_deserializer, details.method.rsplit("/", 1)[-1]

        def lenient(data: bytes):
            try:
                return decode(data)
            except Exception:
                return MALFORMED

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                handler.unary_stream, lenient, handler.response_serializer
            )
        behaviour = handler.unary_unary

        async def unary(request, context):
            if request is MALFORMED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed(method))
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, lenient, handler.response_serializer)


class RouterServer:
    def __init__(
        self,
        dispatcher: Dispatcher,
        mode: str,
        host: str = "127.0.0.1",
        port: int = 50051,
        stats_interval_s: float = 0.5,
        credentials: grpc.ServerCredentials | None = None,
        api_keys: ApiKeys | None = None,
        tool_parser: ToolParser = "hermes",
        routers: Routers | None = None,
        upgrade: Upgrade | None = None,
        relief: Relief | None = None,
    ):
        """``relief``: after each stats poll, move requests off decode workers whose KV
        cache is nearly full (``Moves.relieve``; None: never)."""
        self.dispatcher = dispatcher
        self.routers = routers  # what ClusterStatus lists under routers (None: none)
        self.upgrade = upgrade  # what runs an Upgrade call (None: this router has no pools)
        self.mode = mode
        self.host, self.port = host, port
        self.stats_interval_s = stats_interval_s
        self.credentials = credentials
        self.api_keys = api_keys
        self.tool_parser = tool_parser
        self.health = health.aio.HealthServicer()
        self._serving: bool | None = None  # what health checks are told now
        self._stopping = False
        self._server: grpc.aio.Server | None = None
        self._poller: asyncio.Task | None = None
        self.relief = relief
        self._relieving: asyncio.Task | None = None  # one relieve at a time

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        # The first is outermost: auth wraps the lenient handler the second one makes.
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
        if self.api_keys is not None:
            interceptors.insert(0, GrpcAuthInterceptor(self.api_keys))
        server = grpc.aio.server(interceptors=interceptors)
        service = SplitserveService(self.dispatcher, self.mode, self.tool_parser, self.routers, self.upgrade)
        pb_grpc.add_SplitserveServicer_to_server(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        target = f"{self.host}:{self.port}"
        if self.credentials is not None:
            self.port = server.add_secure_port(target, self.credentials)
        else:
            self.port = server.add_insecure_port(target)
        if self.port == 0:
            raise OSError(f"could not listen on {target} (is the port in use?)")
        await self.dispatcher.registry.poll()
        await server.start()
        self._server = server
        await self._follow_pools()
        self._poller = asyncio.create_task(self._poll_forever())
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking calls; let running ones finish for up to ``grace_s``."""
        self._stopping = True
        await self._set_serving(False)
        for task in (self._poller, self._relieving):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._server is not None:
            await self._server.stop(grace_s)

    async def _set_serving(self, serving: bool) -> None:
        r = health_pb2.HealthCheckResponse
        status = r.SERVING if serving else r.NOT_SERVING
        self._serving = serving
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _follow_pools(self) -> None:
        """Health checks say SERVING while the pool this router cannot serve without
        (decode or colocated: ``Dispatcher.unroutable_roles``) has a routable worker (as
        HTTP ``/health``), NOT_SERVING otherwise and once stopping."""
        serving = not self._stopping and not self.dispatcher.unroutable_roles()
        if serving != self._serving:
            await self._set_serving(serving)

    def _relieve(self) -> None:
        """Start ``Moves.relieve`` on the stats just polled, unless one still runs."""
        if self.relief is None or self._stopping:
            return
        if self._relieving is None or self._relieving.done():
            self._relieving = asyncio.create_task(self._relieve_once(self.relief))

    async def _relieve_once(self, relief: Relief) -> None:
        try:
            moved = await self.dispatcher.moves.relieve(relief)
        except Exception:  # a failed move is the request's; relief tries again next poll
            log.exception("moving requests off full decode workers failed")
            return
        if moved:
            log.info("moved %d request(s) off decode workers whose KV cache was nearly full", moved)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            try:
                await self.dispatcher.registry.poll()
                await self._follow_pools()
                self._relieve()
            except Exception:  # never let status polling take the router down
                log.exception("polling worker stats failed")
