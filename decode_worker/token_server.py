"""Serves a decode worker's ``stream`` and ``start`` over gRPC (``wire.token_stream``
says why and how), on the worker's event loop, on a port of its own chosen at start.

A consumer that goes (cancels the call, or its connection drops) ends the
handler's iteration of ``stream``, whose clean-up aborts every request of that
outbox, as when a Ray stream's reader went.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from splitserve.wire import token_stream as ts
from splitserve.wire.decode import DecodeTask, TokenBatch
from splitserve.wire.errors import InvalidRequest, SplitserveError
from splitserve.wire.net import default_route_ip

Stream = Callable[[str], AsyncIterator[tuple[TokenBatch, ...]]]
Start = Callable[[str, DecodeTask], Awaitable[None]]


class TokenServer:
    """``stream(outbox_id)``'s items to whoever calls ``wire.token_stream.METHOD``, and
    ``start(outbox_id, task)`` for whoever calls ``START``."""

    def __init__(self, stream: Stream, start: Start):
        self._stream, self._start = stream, start
        self._server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self, host: str | None = None) -> str:
        """Listen on ``host`` (this machine's address by default), any free port; the address."""
        host = host or default_route_ip()
        server = grpc.aio.server(
            options=[
                ("grpc.keepalive_time_ms", ts.KEEPALIVE_MS),
                ("grpc.keepalive_timeout_ms", ts.KEEPALIVE_TIMEOUT_MS),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", ts.KEEPALIVE_MS // 2),
                ("grpc.max_send_message_length", ts.MAX_MESSAGE_BYTES),
            ]
        )
        handler = grpc.unary_stream_rpc_method_handler(
            self._serve, request_deserializer=ts.decode_outbox, response_serializer=ts.encode_item
        )
        start = grpc.unary_unary_rpc_method_handler(
            self._serve_start, request_deserializer=ts.decode, response_serializer=ts.encode
        )
        service = grpc.method_handlers_generic_handler(ts.SERVICE, {"Stream": handler, "Start": start})
        server.add_generic_rpc_handlers((service,))
        port = server.add_insecure_port(f"{host}:0")
        await server.start()
        self._server, self.address = server, f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None

    async def _serve_start(self, request: tuple[str, DecodeTask], context) -> SplitserveError | None:
        """None once started; the error ``start`` raised (it holds nothing then), as the answer."""
        try:
            await self._start(*request)
        except SplitserveError as e:
            return e
        return None

    async def _serve(self, outbox_id: str, context: grpc.aio.ServicerContext):
        try:
            async for item in self._stream(outbox_id):
                yield item
        except InvalidRequest as e:  # a second reader of one outbox
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
