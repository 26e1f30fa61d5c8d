"""How the router talks to a worker: the ``WorkerClient`` protocol, and
``RayWorker``, which implements it over a Ray actor handle.

Everything the dispatcher and the registry do to a worker goes through these
six calls, and every error comes back as splitserve's own exception
(``router.errors.unwrap``: a dead actor is ``WorkerLost``), so the request
path never sees Ray, and its tests can drive it with plain fakes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import ray

from splitserve.decode_worker.api import DecodeStats, DecodeTask, DecodeWorkerInfo, TokenBatch
from splitserve.kv_transfer.contract import Confirmation, Handshake
from splitserve.prefill_worker.api import PrefillResult, PrefillStats, PrefillTask, PrefillWorkerInfo
from splitserve.router.errors import unwrap

WorkerStats = PrefillStats | DecodeStats
WorkerInfo = PrefillWorkerInfo | DecodeWorkerInfo


class WorkerClient(Protocol):
    """A prefill, decode or colocated worker as the router sees it. Calls a role does
    not have raise (the router never makes them)."""

    async def info(self) -> WorkerInfo: ...

    async def stats(self) -> WorkerStats: ...

    async def abort(self, request_id: str) -> bool: ...

    async def prefill(self, task: PrefillTask) -> PrefillResult: ...

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None: ...

    async def connect(self, handshakes: tuple[Handshake, ...]) -> None: ...

    def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]: ...


class RayWorker:
    """``WorkerClient`` over a worker actor. ``actor`` is the Ray handle (a restarted
    actor keeps it)."""

    def __init__(self, actor: Any):
        self.actor = actor

    async def info(self) -> WorkerInfo:
        return await _call(self.actor.info.remote())

    async def stats(self) -> WorkerStats:
        return await _call(self.actor.stats.remote())

    async def abort(self, request_id: str) -> bool:
        return await _call(self.actor.abort.remote(request_id))

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await _call(self.actor.prefill.remote(task))

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        await _call(self.actor.confirm.remote(confirmations))

    async def connect(self, handshakes: tuple[Handshake, ...]) -> None:
        await _call(self.actor.connect.remote(handshakes))

    async def generate(self, task: DecodeTask) -> AsyncIterator[TokenBatch]:
        """The worker's stream of batches; leaving it before the last batch cancels the
        worker's generator (which aborts the request there)."""
        stream = self.actor.generate.remote(task)
        finished = False
        try:
            while not finished:
                try:
                    ref = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except (ray.exceptions.RayError, ray.exceptions.ActorUnavailableError) as e:
                    raise unwrap(e) from None
                batch: TokenBatch = await _call(ref)
                finished = batch.finish_reason is not None
                yield batch
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    ray.cancel(stream)


async def _call(ref):
    try:
        return await ref
    except (ray.exceptions.RayError, ray.exceptions.ActorUnavailableError) as e:
        raise unwrap(e) from None
