"""An elastic worker: one engine, loaded once, that serves as a prefill worker, a
decode worker, or both at once, and so changes role without reloading weights.

It is the two halves the cluster already runs, over one engine loop::

    ElasticWorker, a DecodeWorker   takes KV from prefill workers (its sink), decodes,
      engine loop (one Engine,      streams; prefills short prompts itself; moves running
      one thread; outputs, ticks    requests (its mover) and takes moved ones
      and errors go to both halves)
      .prefill  PrefillWorker       prefills prompts for decode workers and exports their
                                    KV (its KV source), lends cached prefixes

Each half keeps its own requests and leases (a prefill export, a decode stream) and
ignores the other's outputs; the engine refuses an id already in use, so one
request id is never in both. Which half the router sends work to is its role
(``router.roles``): a worker switching role stops getting the old role's new work,
finishes (or moves) what it holds in it, and takes the new role's; the engine and
its caches stay as they are, so the switch costs seconds, not a model load.

TP=1 only (a TP group's ranks would each need both halves' peers). No Ray here:
``cluster`` wraps it as it wraps the others.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.loop import EngineLoop
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.wire.decode import DecodeWorkerSpec
from splitserve.wire.kv import Confirmation, KVHandoff
from splitserve.wire.outputs import RequestOutput
from splitserve.wire.prefill import (
    PrefillEvent,
    PrefillStats,
    PrefillTask,
    PrefillWorkerInfo,
    PrefillWorkerSpec,
    PrefixLoan,
)
from splitserve.wire.prefix import PrefixCursor


class ElasticWorker(DecodeWorker):
    """A decode worker whose engine also serves a prefill half (``prefill``): the
    decode calls are its own, the prefill half's are ``prefill_*`` (how
    ``cluster.worker_client.RayPrefillWorker`` calls them on an elastic worker)."""

    def __init__(self, prefill: PrefillWorkerSpec, decode: DecodeWorkerSpec):
        """Both specs name the same worker and engine; TP=1, with a transfer backend
        (the decode half takes KV from elsewhere). Raises ``ValueError`` otherwise."""
        if prefill.worker_id != decode.worker_id or prefill.engine != decode.engine:
            raise ValueError("an elastic worker's halves are one worker with one engine")
        if prefill.tp is not None or decode.tp is not None or decode.engine.ep_size > 1:
            raise ValueError("an elastic worker is one process (TP=1, no expert parallelism)")
        if decode.backend is None:
            raise ValueError("an elastic worker's decode half takes KV from elsewhere: it needs a backend")
        loop = EngineLoop.for_worker(
            decode.worker_id,
            decode.engine,
            None,
            self._both_outputs,
            self._both_tick,
            self._both_error,
            paced=True,  # the decode half takes every hand-over (DecodeWorker.on_outputs)
        )
        loop.build()
        self.prefill: PrefillWorker | None = None  # set once both halves are built
        super().__init__(decode, loop=loop)
        self.prefill = PrefillWorker(prefill, loop=loop)
        self.start_engine()  # the loop steps from here on

    def shutdown(self) -> None:
        super().shutdown()
        self.prefill.shutdown()

    # ---- the prefill half, as a Ray client calls it ("prefill_" + the method) -----------
    async def prefill_info(self) -> PrefillWorkerInfo:
        return await self.prefill.info()

    async def prefill_stats(self, prefix_since: PrefixCursor | None = None) -> PrefillStats:
        return await self.prefill.stats(prefix_since)

    async def prefill_abort(self, request_id: str) -> bool:
        return await self.prefill.abort(request_id)

    async def prefill_confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        await self.prefill.confirm(confirmations)

    async def prefill_lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        return await self.prefill.lend_prefix(loan)

    async def prefill_prefill_stream(self, task: PrefillTask) -> AsyncIterator[PrefillEvent]:
        async for item in self.prefill.prefill_stream(task):
            yield item

    # ---- the engine loop thread: both halves hear it ---------------------------------
    def _both_outputs(self, outputs: list[RequestOutput]) -> None:
        self.on_outputs(outputs)
        if self.prefill is not None:
            self.prefill.on_outputs(outputs)

    def _both_tick(self) -> None:
        self.tick()
        if self.prefill is not None:
            self.prefill.tick()

    def _both_error(self, error: BaseException) -> None:
        self.on_error(error)
        if self.prefill is not None:
            self.prefill.on_error(error)
