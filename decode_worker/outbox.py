"""Token batches on their way out of a decode worker, one ``Outbox`` per consumer.

A router does not open a stream per request: it opens one stream per decode
worker (``DecodeWorker.stream(outbox_id)``) and starts requests on it
(``DecodeWorker.start(outbox_id, task)``). Each engine step puts one
``TokenBatch`` per request into that request's outbox; the stream yields
everything put since the previous item as one tuple, merged per request. So the
cost of crossing processes (one gRPC message, one pickle: ``wire.token_stream``) is paid per step and not
per token of every request, and a consumer slower than the steps gets several
tokens per request in one item instead of falling behind::

    engine step --put(batch) per request--> Outbox.ready --take()--> one item: tuple[TokenBatch, ...]

Lives on the worker's event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio

from splitserve.wire.decode import TokenBatch, merge


class Outbox:
    """The batches of one consumer's requests that it has not taken yet."""

    def __init__(self, outbox_id: str):
        self.outbox_id = outbox_id
        self.reading = False  # a stream() is taking from it
        self._ready: dict[str, list[TokenBatch]] = {}
        self._wakeup = asyncio.Event()

    def put(self, batch: TokenBatch) -> None:
        self._ready.setdefault(batch.request_id, []).append(batch)
        self._wakeup.set()

    def drop(self, request_id: str) -> None:
        """Forget a request's batches not taken yet (its consumer stopped reading it)."""
        self._ready.pop(request_id, None)

    async def take(self) -> tuple[TokenBatch, ...]:
        """Wait until something is ready, then take all of it: one batch per request."""
        while not self._ready:
            self._wakeup.clear()
            await self._wakeup.wait()
        ready, self._ready = self._ready, {}
        return tuple(merge(batches) for batches in ready.values())
