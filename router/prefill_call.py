"""One request's call to a prefill worker, as the dispatcher holds it.

A worker that streams KV (``PrefillWorkerInfo.streams_kv``) is called with
``prefill_stream``, and its handoff arrives before the first token: the
dispatcher starts the decode side on it at once, so the decode worker pulls
layers while the prefill worker computes them, and takes the first token
from ``result()`` afterwards. Other workers are called with ``prefill``::

    PrefillCall.open(worker, task)  waits for the first event:
        KVStreaming    -> streamed = its handoff; result() is still to come
        PrefillResult  -> result is set; the call is over
    result()           the PrefillResult (awaited while streaming); the call is then over
    close()            ends the call however far it got: the prompt leaves the
                       worker's queue in the registry, and a result never taken
                       is aborted on the worker (leaving prefill_stream does it)

A worker lost before the first event raises ``WorkerLost`` from ``open``
(the dispatcher tries another); lost after it, from ``result()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.kv_transfer.contract import KVHandoff
from splitserve.prefill_worker.api import KVStreaming, PrefillResult, PrefillTask, PrefillWorkerInfo
from splitserve.router.errors import WorkerLost
from splitserve.router.registry import WorkerRecord, WorkerRegistry

Within = Callable[[Awaitable[Any]], Awaitable[Any]]  # RequestState.within: the request's deadline


@dataclass(eq=False)
class PrefillCall:
    worker: WorkerRecord
    streamed: KVHandoff | None  # the KV streams under this handoff; the result is still coming
    _result: PrefillResult | None
    _events: AsyncIterator[KVStreaming | PrefillResult] | None = None
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    delivered: bool = False  # the dispatcher passed its first token on

    @classmethod
    async def open(cls, registry: WorkerRegistry, worker: WorkerRecord, task: PrefillTask, within: Within):
        """Send ``task`` to ``worker`` and wait for its first event (see the module docstring)."""
        call = cls(worker, None, None)
        call._stack.enter_context(registry.prefilling(worker, task.request_id, len(task.prompt_token_ids)))
        try:
            info = worker.info
            if isinstance(info, PrefillWorkerInfo) and info.streams_kv:
                call._events = await call._stack.enter_async_context(
                    contextlib.aclosing(worker.client.prefill_stream(task))
                )
                first = await call._next(within)
            else:
                first = await within(worker.client.prefill(task))
            if isinstance(first, KVStreaming):
                call.streamed = first.handoff
            else:
                call._result = first
                await call.close()
        except BaseException:
            await call.close()
            raise
        return call

    @property
    def done(self) -> bool:
        """The result is here."""
        return self._result is not None

    async def result(self, within: Within) -> PrefillResult:
        """The prefill's result: the first token and, unless the request ended at it, the
        handoff (a streamed call's is ``streamed``). Raises what the worker raised;
        ``WorkerLost`` for a lost worker."""
        if self._result is None:
            try:
                self._result = await self._next(within)
            finally:
                await self.close()
        return self._result

    async def close(self) -> None:
        await self._stack.aclose()

    async def _next(self, within: Within) -> KVStreaming | PrefillResult:
        item = await within(anext(self._events, None))
        if item is None or (self.streamed is not None and not isinstance(item, PrefillResult)):
            raise WorkerLost(f"prefill worker {self.worker.worker_id} ended its stream without a result")
        return item
