"""The worker calls over Ray: ``RayPrefillWorker`` and ``RayDecodeWorker``, which
implement the router's ``WorkerClient`` protocol over a Ray actor handle, and
``RayDecodeRank``, through which rank 0 of a decode TP group calls its other ranks.

Every error comes back as splitserve's own exception (``unwrap``: a dead actor is
``WorkerLost``), so neither the router nor a decode worker calling a prefill
worker sees Ray. The two are the only modules' worth of Ray the request path has.

A ``RayPrefillWorker`` holds nothing but the handle: the router puts it into a
``DecodeTask`` (``source``) and the decode worker, in its own process, calls the
prefill worker through it directly (prefill, handshakes, confirmations).

A ``RayDecodeWorker`` starts requests and reads their tokens over a gRPC
connection to the worker (``wire.token_stream``): one per worker and consumer,
on the path where Ray's cost per message would be paid per request and every
step. Its aborts, stats and info go through Ray.

``REMOTE_CALLS`` counts the Ray calls each process made through these clients, by
method name (``remote_calls`` reads it, here or in an actor's process: the tests
and ``bench/request_path`` count the calls one request costs with it).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import ray
import ray.exceptions

from splitserve.wire import token_stream as ts
from splitserve.wire.background import Background, cancelled_by_caller
from splitserve.wire.decode import (
    DecodeStats,
    DecodeTask,
    DecodeWorkerInfo,
    MovedRequest,
    PreCopy,
    RunningLoan,
    TokenBatch,
    merge,
)
from splitserve.wire.engine_commands import LoadAdapter, UnloadAdapter
from splitserve.wire.errors import EngineStopped, WorkerLost, WorkerStopped, WorkerUnreachable
from splitserve.wire.kv import Confirmation, Handshake, KVDescriptor, KVHandoff
from splitserve.wire.prefill import (
    PrefillEvent,
    PrefillResult,
    PrefillStats,
    PrefillTask,
    PrefillWorkerInfo,
    PrefixLoan,
)
from splitserve.wire.prefix import PrefixCursor

REMOTE_CALLS: collections.Counter[str] = collections.Counter()  # method name -> calls, this process

_RAY_ERRORS = (ray.exceptions.RayError, ray.exceptions.ActorUnavailableError)


def unwrap(exc: BaseException) -> BaseException:
    """The exception a worker raised, from Ray's wrapper; ``WorkerLost`` for a dead actor,
    ``WorkerStopped`` for one whose engine stopped."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        exc = exc.cause if exc.cause is not None else exc
    if isinstance(exc, EngineStopped):
        return WorkerStopped(str(exc))
    if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError):
        return WorkerLost(f"a worker was lost: {exc.__class__.__name__}")
    return exc


def _remote(actor: Any, method: str, *args: Any):
    REMOTE_CALLS[method] += 1
    return getattr(actor, method).remote(*args)


async def _call(actor: Any, method: str, *args: Any):
    try:
        return await _remote(actor, method, *args)
    except _RAY_ERRORS as e:
        raise unwrap(e) from None


def remote_calls(actor: Any = None, reset: bool = False) -> dict[str, int]:
    """``REMOTE_CALLS`` of this process, or of ``actor``'s (read there); ``reset`` zeroes them."""

    def read(_self: Any = None) -> dict[str, int]:
        from splitserve.cluster.worker_client import REMOTE_CALLS

        calls = dict(REMOTE_CALLS)
        if reset:
            REMOTE_CALLS.clear()
        return calls

    return read() if actor is None else ray.get(actor.__ray_call__.remote(read))


class _EveryWorker:
    """The calls every role answers, over ``self.actor`` (its methods named ``prefix`` +
    the call: an elastic worker's prefill half answers as ``prefill_info``...)."""

    actor: Any
    prefix = ""

    async def info(self) -> PrefillWorkerInfo | DecodeWorkerInfo:
        return await _call(self.actor, self.prefix + "info")

    async def stats(self, prefix_since: PrefixCursor | None = None) -> PrefillStats | DecodeStats:
        return await _call(self.actor, self.prefix + "stats", prefix_since)

    async def abort(self, request_id: str) -> bool:
        return await _call(self.actor, self.prefix + "abort", request_id)

    async def change_adapters(self, change: LoadAdapter | UnloadAdapter) -> str | None:
        """Load a LoRA adapter (its digest) or unload one, on the worker's engine (one
        engine for both halves of an elastic worker: no prefix)."""
        return await _call(self.actor, "change_adapters", change)


@dataclasses.dataclass(frozen=True, eq=False)
class RayPrefillWorker(_EveryWorker):
    """A prefill worker's actor, or an elastic worker's prefill half (``prefix``
    "prefill_"). Plain (picklable): it travels in ``DecodeTask.source``."""

    actor: Any  # the Ray handle (a restarted actor keeps it)
    prefix: str = ""  # "prefill_" on an elastic worker (elastic_worker.worker)

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        await _call(self.actor, self.prefix + "confirm", confirmations)

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        return await _call(self.actor, self.prefix + "lend_prefix", loan)

    async def prefill_stream(self, task: PrefillTask) -> AsyncIterator[PrefillEvent]:
        stream = _remote(self.actor, self.prefix + "prefill_stream", task)
        finished = False
        try:
            async for ref in stream:
                item = await ref
                finished = isinstance(item, PrefillResult)
                yield item
        except _RAY_ERRORS as e:
            raise unwrap(e) from None
        finally:
            if not finished:
                ray.cancel(stream)  # the worker's generator ends, aborting the request there

    async def close(self) -> None:
        """Nothing is held open to a prefill worker."""


@dataclasses.dataclass(frozen=True, eq=False)
class RayDecodePeer(_EveryWorker):
    """A decode worker as another decode worker calls it to take over a request it moved
    away (a ``DecodePeer``). Plain (picklable): it travels in ``DecodeTask.moved_from``."""

    actor: Any  # the Ray handle

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        await _call(self.actor, "confirm", confirmations)

    async def lend_running(self, loan: RunningLoan) -> KVHandoff | None:
        return await _call(self.actor, "lend_running", loan)

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        return await _call(self.actor, "lend_prefix", loan)


@dataclasses.dataclass(frozen=True, eq=False)
class RayDecodeRank:
    """Rank r > 0 of a decode worker's TP group (a ``DecodeRankPeer``): rank 0 holds
    one per other rank and calls it for each source's link and each request's pull."""

    actor: Any  # the Ray handle of the DecodeRank

    async def link(self, handshakes: tuple[Handshake, ...]) -> None:
        await _call(self.actor, "link", handshakes)

    async def pull(
        self, descriptors: tuple[KVDescriptor, ...], blocks: list[int], timeout: float
    ) -> tuple[list[Confirmation], float]:
        return await _call(self.actor, "pull", descriptors, blocks, timeout)


class RayDecodeWorker(_EveryWorker):
    """A decode (or colocated) worker's actor. Its requests' batches come over one gRPC
    stream per client (``_Inbox``), opened by the first ``generate``."""

    def __init__(self, actor: Any):
        self.actor = actor  # the Ray handle (a restarted actor keeps it)
        self._inbox: _Inbox | None = None  # made by the first generate, on the caller's loop
        self._aborting = Background()  # aborts of requests the caller left early

    async def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        """The request's batches, up to the one with ``finish_reason``; a batch's
        ``error`` is raised (after its tokens). Batches that arrived while the caller was
        busy come as one (``merge``): a slow consumer pays per message, not per token.
        Leaving early aborts the request on the worker, which lets go of whatever it
        holds elsewhere for it."""
        if self._inbox is None or self._inbox.closed:
            self._inbox = _Inbox(self.actor)
        inbox, rid = self._inbox, task.request_id
        queue = inbox.open(rid)
        started = finished = False
        failed: BaseException | None = None  # the stream's failure, queued behind batches
        try:
            await inbox.start(task)
            started = True  # a start that raised holds nothing there
            while not finished:
                item = failed if failed is not None else await queue.get()
                if isinstance(item, BaseException):
                    raise item
                item, failed = _ready(item, queue)
                if item.error is not None:
                    if item.token_ids or item.prefilled is not None:
                        yield dataclasses.replace(item, error=None)
                    finished = True
                    raise item.error
                finished = item.finish_reason is not None or item.moved  # moved: nothing held there
                yield item
        finally:
            inbox.close(rid)
            if started and not finished:  # not awaited; its errors are of no interest
                self._aborting.run(self.abort(rid))

    async def move_out(self, request_id: str, export: bool = True, from_block: int = 0) -> MovedRequest:
        """Let go of a running request for another decode worker (live migration)."""
        return await _call(self.actor, "move_out", request_id, export, from_block)

    async def precopy(self, task: PreCopy) -> int:
        """Copy a request's KV ahead of its move here (live migration's pre-copy)."""
        return await _call(self.actor, "precopy", task)

    def peer(self) -> RayDecodePeer:
        """This worker as the one taking over its moved request calls it."""
        return RayDecodePeer(self.actor)

    async def close(self) -> None:
        """Stop reading the worker's tokens (its requests from here are aborted there)."""
        if self._inbox is not None:
            await self._inbox.close_all()


def _ready(first: TokenBatch, queue: asyncio.Queue) -> tuple[TokenBatch, BaseException | None]:
    """``first`` and the batches queued behind it, as one; a failure queued after them, apart."""
    batches: list[TokenBatch] = [first]
    while not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, BaseException):
            return merge(batches), item
        batches.append(item)
    return merge(batches), None


class _Inbox:
    """One connection to a decode worker's token server (``wire.token_stream``, at its
    ``token_address``): requests start over it (``start``) and their tokens come back on
    one stream, read by one task that hands each request's batches to its queue. A
    failed stream fails every request open on it (``WorkerLost``); the next request
    opens a new inbox (and asks the address again: a restarted worker serves on another
    port)."""

    def __init__(self, actor: Any):
        self.inbox_id = uuid.uuid4().hex
        self.closed = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._channel: asyncio.Future = asyncio.ensure_future(self._connect(actor))
        self._reader = asyncio.ensure_future(self._read())

    def open(self, request_id: str) -> asyncio.Queue:
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def start(self, task: DecodeTask) -> None:
        """``DecodeWorker.start`` over the connection; raises what it raised, or
        ``WorkerUnreachable`` if the start was not answered (the worker cannot be reached,
        its engine stopped, or the connection closed with the call in flight: the stream
        broke, and grpc.aio cancels every call on a closed channel). A cancellation of the
        caller's own task (its client left, its deadline passed) is raised as it is."""
        try:
            channel = await asyncio.shield(self._channel)
            call = channel.unary_unary(
                ts.START, request_serializer=ts.encode, response_deserializer=ts.decode
            )
            error = await call((self.inbox_id, task))
        except grpc.aio.AioRpcError as e:
            raise WorkerUnreachable(
                f"a decode worker could not be reached ({e.code().name}: {e.details()})"
            ) from None
        except WorkerLost as e:  # asking for its address
            raise WorkerUnreachable(str(e)) from None
        except asyncio.CancelledError:
            if cancelled_by_caller():
                raise
            raise WorkerUnreachable(
                "a decode worker's connection closed before it answered the start"
            ) from None
        if isinstance(error, EngineStopped):
            raise WorkerUnreachable(f"a decode worker's engine has stopped: {error}")
        if error is not None:
            raise error

    async def close_all(self) -> None:
        self._reader.cancel()
        await asyncio.wait([self._reader])

    async def _connect(self, actor: Any) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(await _call(actor, "token_address"), options=_CHANNEL_OPTIONS)

    async def _read(self) -> None:
        error: BaseException = WorkerLost("a decode worker ended its token stream")
        channel = None
        try:
            channel = await self._channel
            read = channel.unary_stream(
                ts.METHOD, request_serializer=ts.encode_outbox, response_deserializer=ts.decode_item
            )
            async for item in read(self.inbox_id):
                for batch in item:
                    queue = self._queues.get(batch.request_id)
                    if queue is not None:
                        queue.put_nowait(batch)
        except grpc.aio.AioRpcError as e:
            error = WorkerLost(f"a decode worker's token stream broke ({e.code().name}: {e.details()})")
        except (WorkerLost, WorkerStopped) as e:  # asking for the address
            error = e
        except asyncio.CancelledError:  # the call is cancelled with the channel: the worker's
            error = WorkerLost("the router stopped reading a decode worker's tokens")  # stream
            raise  # ends there, aborting what it still runs for us
        finally:
            self.closed = True
            for queue in self._queues.values():
                queue.put_nowait(error)
            if channel is not None:
                await channel.close()
            else:
                self._channel.cancel()


_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", ts.KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", ts.KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", ts.MAX_MESSAGE_BYTES),
]
