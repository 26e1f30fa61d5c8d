"""How the router talks to a worker: the ``WorkerClient`` protocol, and
``RayWorker``, which implements it over a Ray actor handle.

Everything the dispatcher and the registry do to a worker goes through these
calls, and every error comes back as splitserve's own exception
(``router.errors.unwrap``: a dead actor is ``WorkerLost``), so the request
path never sees Ray, and its tests can drive it with plain fakes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import ray

from splitserve.decode_worker.api import DecodeStats, DecodeTask, DecodeWorkerInfo, TokenBatch
from splitserve.engine.prefix_cache import PrefixCursor
from splitserve.kv_transfer.contract import Confirmation, Handshake
from splitserve.prefill_worker.api import (
    KVStreaming,
    PrefillResult,
    PrefillStats,
    PrefillTask,
    PrefillWorkerInfo,
)
from splitserve.router.background import Background
from splitserve.router.errors import WorkerLost, unwrap

WorkerStats = PrefillStats | DecodeStats
WorkerInfo = PrefillWorkerInfo | DecodeWorkerInfo


class WorkerClient(Protocol):
    """A prefill, decode or colocated worker as the router sees it. Calls a role does
    not have raise (the router never makes them)."""

    async def info(self) -> WorkerInfo: ...

    async def stats(self, prefix_since: PrefixCursor | None = None) -> WorkerStats:
        """Load figures, with the worker's prefix-cache changes since ``prefix_since``."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    async def prefill(self, task: PrefillTask) -> PrefillResult: ...

    def prefill_stream(self, task: PrefillTask) -> AsyncIterator[KVStreaming | PrefillResult]:
        """A prefill worker's ``prefill_stream``: at most one ``KVStreaming``, then the
        ``PrefillResult``. Leaving early aborts the request on the worker."""
        ...

    async def first_token(self, request_id: str, token_ids: list[int]) -> bool:
        """A decode worker's request started with a streamed handoff (its ``generate``
        running) gets its first token, once the worker took the request. False if it
        did not, or the request is over there."""
        ...

    async def prefill_lost(self, request_id: str, reason: str) -> bool:
        """A decode worker's request started with a streamed handoff will get no first
        token: it ends there with ``PeerLost`` (its stream says so). False as for
        ``first_token``."""
        ...

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None: ...

    async def connect(self, handshakes: tuple[Handshake, ...]) -> None: ...

    def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        """The request's batches, up to the one with ``finish_reason``. A batch's
        ``error`` is raised after its tokens; a lost worker is ``WorkerLost``.
        Leaving early aborts the request on the worker (its blocks are freed)."""
        ...

    async def close(self) -> None:
        """Let go of what this client keeps open to the worker (a decode worker's token
        stream; requests still running on it are aborted there). Before removal."""


class RayWorker:
    """``WorkerClient`` over a worker actor. ``actor`` is the Ray handle (a restarted
    actor keeps it)."""

    def __init__(self, actor: Any):
        self.actor = actor
        self._inbox: _Inbox | None = None  # made by the first generate, on the router's loop
        self._aborting = Background()  # aborts of requests the caller left early
        # request id -> its start call's outcome, while generate runs: Ray does not order
        # calls to an async actor, so first_token and prefill_lost wait for it
        self._starts: dict[str, asyncio.Future] = {}

    async def info(self) -> WorkerInfo:
        return await _call(self.actor.info.remote())

    async def stats(self, prefix_since: PrefixCursor | None = None) -> WorkerStats:
        return await _call(self.actor.stats.remote(prefix_since))

    async def abort(self, request_id: str) -> bool:
        return await _call(self.actor.abort.remote(request_id))

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await _call(self.actor.prefill.remote(task))

    async def prefill_stream(self, task: PrefillTask) -> AsyncIterator[KVStreaming | PrefillResult]:
        stream = self.actor.prefill_stream.remote(task)
        finished = False
        try:
            async for ref in stream:
                item = await _call(ref)
                finished = isinstance(item, PrefillResult)
                yield item
        except (ray.exceptions.RayError, ray.exceptions.ActorUnavailableError) as e:
            raise unwrap(e) from None
        finally:
            if not finished:
                ray.cancel(stream)  # the worker's generator ends, aborting the request there

    async def first_token(self, request_id: str, token_ids: list[int]) -> bool:
        if not await self._started(request_id):
            return False
        return await _call(self.actor.first_token.remote(request_id, token_ids))

    async def prefill_lost(self, request_id: str, reason: str) -> bool:
        if not await self._started(request_id):
            return False
        return await _call(self.actor.prefill_lost.remote(request_id, reason))

    async def _started(self, request_id: str) -> bool:
        """Whether the worker took ``request_id`` (its start call returned), once known."""
        start = self._starts.get(request_id)
        if start is None:  # its generate is over, or never began
            return False
        await asyncio.wait([start])
        return not start.cancelled() and start.exception() is None

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        await _call(self.actor.confirm.remote(confirmations))

    async def connect(self, handshakes: tuple[Handshake, ...]) -> None:
        await _call(self.actor.connect.remote(handshakes))

    async def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        """The request's batches, up to the one with ``finish_reason``; a batch's
        ``error`` is raised (after its tokens). Leaving early aborts the request on
        the worker."""
        if self._inbox is None or self._inbox.closed:
            self._inbox = _Inbox(self.actor)
        inbox, rid = self._inbox, task.request_id
        queue = inbox.open(rid)
        started = finished = False
        start = self._starts[rid] = asyncio.get_running_loop().create_future()
        try:
            try:
                await _call(self.actor.start.remote(inbox.inbox_id, task))
            except Exception as e:
                start.set_exception(e)
                raise
            start.set_result(None)
            started = True  # a start that raised holds nothing there
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    if item.token_ids:
                        yield dataclasses.replace(item, error=None)
                    finished = True
                    raise item.error
                finished = item.finish_reason is not None
                yield item
        finally:
            inbox.close(rid)
            if self._starts.get(rid) is start:
                del self._starts[rid]
            if not start.done():
                start.cancel()
            elif not start.cancelled():
                start.exception()  # retrieved: the caller of generate has it
            if started and not finished:  # not awaited; its errors are of no interest
                self._aborting.run(self.abort(rid))

    async def close(self) -> None:
        """Stop reading the worker's tokens (its requests from here are aborted there)."""
        if self._inbox is not None:
            await self._inbox.close_all()


class _Inbox:
    """One Ray stream from a decode worker, read by one task that hands each
    request's batches to its queue. A failed stream fails every request open on it
    (``WorkerLost`` for a dead worker); the next request opens a new inbox."""

    def __init__(self, actor: Any):
        self.inbox_id = uuid.uuid4().hex
        self.closed = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader = asyncio.ensure_future(self._read(actor.stream.remote(self.inbox_id)))

    def open(self, request_id: str) -> asyncio.Queue:
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def close_all(self) -> None:
        self._reader.cancel()
        await asyncio.wait([self._reader])

    async def _read(self, stream) -> None:
        error: BaseException = WorkerLost("a decode worker ended its token stream")
        try:
            async for ref in stream:
                for batch in await ref:
                    queue = self._queues.get(batch.request_id)
                    if queue is not None:
                        queue.put_nowait(batch)
        except (ray.exceptions.RayError, ray.exceptions.ActorUnavailableError) as e:
            error = unwrap(e)
        except asyncio.CancelledError:
            error = WorkerLost("the router stopped reading a decode worker's tokens")
            ray.cancel(stream)  # the worker's stream ends, aborting what it still runs for us
            raise
        finally:
            self.closed = True
            for queue in self._queues.values():
                queue.put_nowait(error)


async def _call(ref):
    try:
        return await ref
    except (ray.exceptions.RayError, ray.exceptions.ActorUnavailableError) as e:
        raise unwrap(e) from None
