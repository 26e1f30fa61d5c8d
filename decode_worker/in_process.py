"""A decode (or colocated) worker in this process as a router calls it: the
``router.workers.WorkerClient`` protocol over a ``DecodeWorker`` on the same
asyncio loop, no Ray. For tests and benchmarks that put a real engine behind a
real router in one process (``cluster.worker_client`` is the same over Ray).

One outbox per client, read by one task that hands each request's batches to
its queue; a batch's ``error`` is raised after its tokens, and leaving a
request early aborts it on the worker."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator

from splitserve.decode_worker.worker import DecodeWorker
from splitserve.wire.decode import (
    DecodeStats,
    DecodeTask,
    DecodeWorkerInfo,
    MovedRequest,
    PreCopy,
    TokenBatch,
)
from splitserve.wire.engine_commands import LoadAdapter, UnloadAdapter
from splitserve.wire.prefix import PrefixCursor


class InProcessDecodeClient:
    def __init__(self, worker: DecodeWorker):
        self.worker = worker
        self.worker_id = worker.worker_id
        self._outbox = uuid.uuid4().hex
        self._queues: dict[str, asyncio.Queue[TokenBatch]] = {}
        self._reader: asyncio.Task | None = None

    async def info(self) -> DecodeWorkerInfo:
        return await self.worker.info()

    async def stats(self, prefix_since: PrefixCursor | None = None) -> DecodeStats:
        return await self.worker.stats(prefix_since)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def change_adapters(self, change: LoadAdapter | UnloadAdapter) -> str | None:
        return await self.worker.change_adapters(change)

    async def move_out(self, request_id: str, export: bool = True, from_block: int = 0) -> MovedRequest:
        return await self.worker.move_out(request_id, export, from_block)

    async def precopy(self, task: PreCopy) -> int:
        return await self.worker.precopy(task)

    def peer(self) -> DecodeWorker:
        """The worker itself: another on this loop calls it directly."""
        return self.worker

    async def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        rid = task.request_id
        queue = self._queues[rid] = asyncio.Queue()
        finished = False
        try:
            await self.worker.start(self._outbox, task)  # raises holding nothing
            if self._reader is None:
                self._reader = asyncio.ensure_future(self._read())
            while not finished:
                batch = await queue.get()
                if batch.error is not None:
                    finished = True
                    if batch.token_ids:
                        yield dataclasses.replace(batch, error=None)
                    raise batch.error
                finished = batch.finish_reason is not None or batch.moved  # moved: nothing held there
                yield batch
        finally:
            self._queues.pop(rid, None)
            if not finished:
                await self.worker.abort(rid)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None

    async def _read(self) -> None:
        async for batches in self.worker.stream(self._outbox):
            for batch in batches:
                queue = self._queues.get(batch.request_id)
                if queue is not None:
                    queue.put_nowait(batch)
