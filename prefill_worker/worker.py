"""The prefill worker: an engine that only prefills, and a KV source that ships
what it computed.

A request's life here (the engine batches prompts up to its token budget and
chunks long ones)::

    prefill(task) --add_request(prefill_only)--> WAITING/RUNNING in the engine
        --first token sampled--> PREFILLED --source.export--> EXPORTED (lease)
        --decode worker confirms | lease expires | abort()--> blocks released

A decode worker confirms through the backend's own channel (nixl,
torch_dist, ucx), or, for a backend without one (ray), by calling ``confirm``
itself right after its pull; either way the blocks are freed at the pull.

Each layer of a prompt is hashed right after the forward pass writes it (the
engine's ``LayerObserver`` is a ``kv_transfer.layerwise.LayerExporter``), so
the export after the step only publishes. With ``spec.stream_kv`` (and a
backend that streams, TP=1), the export opens when the prompt's last prefill
step begins and each layer is announced as it is written; ``prefill_stream``
then yields the handoff at once (``KVStreaming``), so the decode worker pulls
layer k while layer k+1 computes, and the ``PrefillResult`` (the first token)
follows::

    prefill_stream(task) -> KVStreaming(handoff)   the last step's forward pass begins
                         -> PrefillResult           first token sampled (same handoff)

``prefill`` returns once the first token is sampled and the KV is exported;
the blocks stay held until ``KVSource.poll`` reports the lease's end. A
poller thread calls ``poll`` every millisecond, because a NIXL source only
makes progress when polled, and a decode worker's pull must not wait for a
prefill step (a 512-token chunk takes over a second on one CPU core) to end;
lease ends are handed to the engine thread, which releases the blocks on its
next tick. The source is shared by two threads under ``_source_lock``. A
cancelled or timed-out ``prefill`` aborts its request, so no path leaves
blocks behind.

Prefixes between prefill workers (TP=1): a task whose ``prefix_from`` names
another prefill worker first copies the prompt's leading blocks from it
(``prefill_worker.borrow``: a sink of its own on the same cache, one more NIXL
agent) and computes only the rest, or everything if the copy fails;
``lend_prefix`` is the other side, an export of cached blocks under a lease,
ended like any export's.

With ``spec.tp`` set the worker is rank 0 of a tensor-parallel group whose
other ranks are ``PrefillRank``s (``splitserve.prefill_worker.tp`` describes
the protocol); each request's result then also carries every other rank's KV
shard, and its blocks are released once every rank's lease ended.

The class imports no Ray: ``cluster`` wraps it with ``ray.remote`` (it is an
asyncio actor), and tests can drive it with plain asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from splitserve.engine.engine import Engine
from splitserve.engine.loop import EngineLoop
from splitserve.engine.parallel.worker_group import Heartbeats
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.layerwise import LayerExporter
from splitserve.kv_transfer.tp_mapping import readers_of
from splitserve.prefill_worker.borrow import Borrowed, PrefixBorrower
from splitserve.prefill_worker.exports import ExportLedger
from splitserve.prefill_worker.tp import (
    ConfirmShard,
    ExportShard,
    PollShards,
    ReleaseShard,
    join_prefill_group,
)
from splitserve.wire.errors import (
    DeadlineExceeded,
    EngineStopped,
    InvalidRequest,
    KVTransferError,
    UnknownRequest,
)
from splitserve.wire.kv import CompatInfo, Confirmation, KVDescriptor, KVHandoff, LeaseEnd, TransferState
from splitserve.wire.outputs import RequestOutput
from splitserve.wire.prefill import (
    KVStreaming,
    PrefillResult,
    PrefillStats,
    PrefillTask,
    PrefillWorkerInfo,
    PrefillWorkerSpec,
    PrefixLoan,
)
from splitserve.wire.prefix import PrefixCursor
from splitserve.wire.sampling import FinishReason

log = logging.getLogger(__name__)


@dataclass
class _Waiter:
    """A ``prefill`` call awaiting its request. Resolved from the engine thread."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future  # the PrefillResult
    streamed: asyncio.Future | None = None  # the KVHandoff, once its export streams (prefill_stream)
    deadline: float | None = None  # loop.time() past which the call gives up
    readers: tuple[int, ...] = (1,)  # per TP rank here: the decode ranks that read its export
    borrowed: Borrowed | None = None  # its prompt's prefix, pulled from another prefill worker

    def resolve(self, result: PrefillResult | None = None, error: BaseException | None = None) -> None:
        def _set() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(_set)

    def announce(self, handoff: KVHandoff) -> None:
        def _set() -> None:
            if self.streamed is not None and not self.streamed.done():
                self.streamed.set_result(handoff)

        self.loop.call_soon_threadsafe(_set)


class PrefillWorker:
    def __init__(self, spec: PrefillWorkerSpec):
        if spec.tp is not None and spec.tp.rank != 0:
            raise ValueError("a PrefillWorker is rank 0 of its TP group; the others are PrefillRanks")
        self.spec = spec
        self.worker_id = spec.worker_id
        self.tp = join_prefill_group(spec)
        # the engine is built on the loop's thread, the one that steps it (engine/loop.py says why)
        self.loop = EngineLoop(
            lambda: Engine(spec.engine, tp=self.tp),
            self._on_outputs,
            self._on_tick,
            name=f"{spec.worker_id}-engine",
            on_error=self._on_error,
        )
        self.engine = self.loop.build()
        kv = self.engine.kv_cache
        compat = CompatInfo(spec.engine.model, kv.layout, kv.scale_values())
        backend = get_backend(spec.backend)
        self.source = backend.source(spec.worker_id, self.engine.kv_cache.tensor, compat, spec.lease_s)
        self.handshakes = tuple(self.tp.gather_object(self.source.handshake()))  # every rank's
        self._readers_by_tp: dict[int, tuple[int, ...]] = {}  # see _readers
        self._waiters: dict[str, _Waiter] = {}  # requests whose prefill() is awaiting
        self.ledger = ExportLedger()  # what is held under a lease (engine thread only)
        self._heartbeats = Heartbeats(self.tp, spec.tp)
        self._source_lock = threading.Lock()
        # hashes each layer as prefill writes it, so exporting hashes nothing (TP=1: the
        # other ranks of a TP group hash their shards at export)
        self.streams_kv = spec.stream_kv and self.source.streams and self.tp.size == 1
        self.exporter = LayerExporter(
            self.source,
            stream=self.streams_kv,
            lock=self._source_lock,
            on_stream=self._on_stream,
            readers=self._stream_readers,
        )
        self.borrower: PrefixBorrower | None = None  # pulls prefixes from other prefill workers
        if self.tp.size == 1:
            self.engine.layer_observer = self.exporter
            sink = backend.sink(f"{spec.worker_id}/borrow", self.engine.kv_cache.tensor, compat)
            call = lambda fn: asyncio.wrap_future(self.loop.call(fn))  # noqa: E731
            timeout = spec.transfer_timeout_s or spec.lease_s
            self.borrower = PrefixBorrower(spec.worker_id, sink, spec.engine.block_size, call, timeout)
        self._ended: queue.SimpleQueue[LeaseEnd] = queue.SimpleQueue()  # poller -> engine thread
        self._stopping = threading.Event()
        self.loop.start()
        self._poller = threading.Thread(
            target=self._poll_source, name=f"{spec.worker_id}-kv-poll", daemon=True
        )
        self._poller.start()

    # ---- called by the router (asyncio) ------------------------------------------
    async def info(self) -> PrefillWorkerInfo:
        return PrefillWorkerInfo(
            self.worker_id,
            self.engine.validator,
            self.handshakes,
            self.engine.summary,
            self.streams_kv,
            self.engine.capacity.bytes_per_token,
        )

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Prefill ``task`` and export its KV. Raises ``InvalidRequest`` for bad
        input, ``DeadlineExceeded`` past ``task.timeout_s``."""
        async with self._prefilling(task, stream=False) as waiter:
            return await self._within(task, waiter.future, waiter.deadline)

    async def prefill_stream(self, task: PrefillTask) -> AsyncIterator[KVStreaming | PrefillResult]:
        """As ``prefill``, yielding the ``PrefillResult`` last; before it, where this worker
        streams KV (``info().streams_kv``), a ``KVStreaming`` as the prompt's last prefill
        step begins, unless that step has already finished when this coroutine wakes (the
        result is there: only it is yielded, and the KV goes whole). Its lease runs from
        then; a caller that leaves before the result releases it (the pull then fails
        with ``LeaseExpired``)."""
        async with self._prefilling(task, stream=self.streams_kv) as waiter:
            if waiter.streamed is not None:
                either = asyncio.wait([waiter.streamed, waiter.future], return_when=asyncio.FIRST_COMPLETED)
                await self._within(task, either, waiter.deadline)
                if waiter.streamed.done() and not waiter.future.done():
                    yield KVStreaming(task.request_id, waiter.streamed.result())
            result = await self._within(task, waiter.future, waiter.deadline)
        yield result  # outside: a caller that leaves now must not release what it was handed

    @contextlib.asynccontextmanager
    async def _prefilling(self, task: PrefillTask, stream: bool) -> AsyncIterator[_Waiter]:
        """Add ``task`` to the engine and wait for it inside; leaving early (an error, a
        cancel, the deadline) aborts it here, with whatever it holds."""
        rid = task.request_id
        if rid in self._waiters:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        loop = asyncio.get_running_loop()
        deadline = None if task.timeout_s is None else loop.time() + task.timeout_s
        readers = self._readers(task.reader_tp)
        streamed = loop.create_future() if stream else None
        waiter = _Waiter(loop, loop.create_future(), streamed, deadline, readers)

        def add(engine: Engine) -> str:  # raises InvalidRequest, e.g. for an id still held here
            if waiter.borrowed is not None:  # in the same call: the prompt finds them cached
                engine.adopt_prefix(waiter.borrowed.loan_id, waiter.borrowed.num_blocks)
            return engine.add_request(
                task.prompt_token_ids,
                task.params,
                rid,
                prefill_only=True,
                export_from_block=task.export_from_block,
            )

        self._waiters[rid] = waiter  # before the engine sees the request: no output is missed
        try:
            if task.prefix_from is not None and self.borrower is not None:
                waiter.borrowed = await self.borrower.borrow(task)
            try:
                await asyncio.wrap_future(self.loop.call(add))
            except BaseException:
                if waiter.borrowed is not None:  # not adopted if add never ran (idempotent)
                    self.loop.call(lambda e: e.abort(waiter.borrowed.loan_id))
                raise
            try:
                yield waiter
            except BaseException:  # deadline, cancel, or the caller left: it will not take the KV
                self._abort_later(rid)
                raise
        finally:
            self._waiters.pop(rid, None)

    def _readers(self, reader_tp: int) -> tuple[int, ...]:
        """Per rank here, how many ranks of a decode group of ``reader_tp`` read its export:
        each KV head is read once per decode rank holding it, from the lowest rank here
        that holds it (a replica no one reads: 0). ``InvalidRequest`` for a size the
        model's KV heads do not split over or replicate across."""
        readers = self._readers_by_tp.get(reader_tp)
        if readers is None:
            if reader_tp < 1:
                raise InvalidRequest(f"reader_tp must be >= 1, got {reader_tp}")
            heads = self.engine.model_config.num_kv_heads
            try:
                readers = tuple(readers_of(r, self.tp.size, reader_tp, heads) for r in range(self.tp.size))
            except ValueError as e:
                raise InvalidRequest(f"no decode group of TP={reader_tp} can take this KV: {e}") from None
            self._readers_by_tp[reader_tp] = readers
        return readers

    def _stream_readers(self, request_id: str) -> int:  # engine thread
        """The readers of a streamed export (TP=1 here: rank 0's count)."""
        waiter = self._waiters.get(request_id)
        return waiter.readers[0] if waiter is not None else 1

    @staticmethod
    async def _within(task: PrefillTask, awaitable, deadline: float | None):
        try:
            async with asyncio.timeout_at(deadline):
                return await awaitable
        except TimeoutError:
            raise DeadlineExceeded(
                f"request {task.request_id} was not prefilled within {task.timeout_s:.3g} s"
            ) from None

    async def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` wherever it is here: queued, prefilling, or exported
        and waiting for a decode worker (its lease is released). Idempotent."""
        return await asyncio.wrap_future(self.loop.call(lambda e: self._abort(request_id)))

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        """Export the cached blocks of ``loan`` this worker holds from ``loan.from_block``
        on (``Engine.lend_prefix``), under a lease like a prefill's: the borrower's
        confirmation, ``abort(loan.request_id)`` or the lease's end frees them. None
        when it holds none of them, or is a TP group (whose ranks would each lend a
        shard; not done)."""
        if self.tp.size > 1:
            return None

        def lend(engine: Engine) -> KVHandoff | None:
            lent = engine.lend_prefix(loan.request_id, loan.token_ids, loan.from_block)
            if lent is None:
                return None
            try:
                with self._source_lock:
                    desc = self.source.export(loan.request_id, lent.block_ids, lent.num_kv_tokens)
            except BaseException:
                engine.release(loan.request_id)
                raise
            self.ledger.opened(loan.request_id, desc.transfer_id)
            return KVHandoff(self.worker_id, (desc,))

        return await asyncio.wrap_future(self.loop.call(lend))

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        """A decode worker holds verified copies of these transfers (for backends that
        confirm through the control plane): end their leases. Unknown or ended
        transfers are ignored."""
        mine = [c.transfer_id for c in confirmations if c.source_worker == self.worker_id]
        if mine:
            with self._source_lock:
                for transfer_id in mine:
                    self.source.confirm(transfer_id)  # the poller reports the lease end
        shards = tuple(c.transfer_id for c in confirmations if c.source_worker != self.worker_id)
        if shards:
            self.loop.call(lambda e: self.tp.broadcast_object(ConfirmShard(shards)))

    async def stats(self, prefix_since: PrefixCursor | None = None) -> PrefillStats:
        """Load and lease figures, and the prefix cache's changes since ``prefix_since``."""

        def snapshot(engine: Engine) -> PrefillStats:
            ends = self.ledger.lease_ends
            return PrefillStats(
                self.worker_id,
                engine.stats(),
                tuple(sorted(self.ledger.held())),
                leases_confirmed=ends[TransferState.CONFIRMED],
                leases_expired=ends[TransferState.EXPIRED],
                leases_released=ends[TransferState.RELEASED],
                prefix=engine.prefix_update(prefix_since),
                prefix_pulls=self.borrower.pulls if self.borrower is not None else 0,
                prefix_pull_failures=self.borrower.failures if self.borrower is not None else 0,
            )

        return await asyncio.wrap_future(self.loop.call(snapshot))

    def shutdown(self) -> None:
        self._stopping.set()
        self._poller.join(5)
        self.loop.stop()
        if self.loop.error is None:
            self.engine.stop_followers()
        with self._source_lock:
            self.source.close()
        if self.borrower is not None:
            self.borrower.close()
        self.tp.destroy()

    # ---- the poller thread ----------------------------------------------------------
    def _poll_source(self, interval_s: float = 0.001) -> None:
        while not self._stopping.is_set():
            try:
                with self._source_lock:
                    ended = self.source.poll()
            except Exception:  # keep polling: a stuck source would stall every pull
                log.exception("polling the KV source failed")
                ended = []
            for end in ended:
                self._ended.put(end)
            time.sleep(interval_s)

    # ---- the engine loop thread ----------------------------------------------------
    def _abort_later(self, request_id: str) -> None:
        self.loop.call(lambda e: self._abort(request_id))

    def _on_error(self, error: BaseException) -> None:
        """The engine loop died (a bug, or a lost TP rank): fail every waiting request now."""
        for waiter in list(self._waiters.values()):
            waiter.resolve(error=EngineStopped(f"prefill worker {self.worker_id} stopped: {error}"))

    def _abort(self, request_id: str) -> bool:
        transfer_id = self.ledger.transfer(request_id)
        if transfer_id is not None:
            with self._source_lock:
                self.source.release(transfer_id)  # the lease end frees the blocks on a later tick
            return True
        return self.engine.abort(request_id)

    def _on_stream(self, descriptors: list[KVDescriptor]) -> None:
        """A step begins whose forward pass completes these prompts, and their exports
        stream (before the pass): abort releases them from now on, and a
        ``prefill_stream`` caller gets its handoff."""
        for desc in descriptors:
            self.ledger.opened(desc.request_id, desc.transfer_id)
            waiter = self._waiters.get(desc.request_id)
            if waiter is not None:
                waiter.announce(KVHandoff(self.worker_id, (desc,)))

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if not out.finished:
                continue
            rid = out.request_id
            waiter = self._waiters.get(rid)
            if waiter is None or out.finish_reason != FinishReason.PREFILL_DONE:
                self.exporter.discard(rid)  # nothing will be exported
            if waiter is None:  # its caller is gone: nobody will take the KV
                if out.finish_reason == FinishReason.PREFILL_DONE:
                    self.engine.release(rid)
                continue
            if out.error is not None:  # it failed alone in the engine (which freed its blocks)
                waiter.resolve(error=out.error)
                continue
            try:
                waiter.resolve(self._result(out, waiter))
            except Exception as e:  # export failed: give the blocks back, tell the caller
                log.exception("exporting the KV of %s failed", rid)
                self.exporter.discard(rid)  # what it hashed (or began streaming) for it
                if rid in self.engine.requests:
                    self.engine.release(rid)
                waiter.resolve(error=e)

    def _result(self, out: RequestOutput, waiter: _Waiter) -> PrefillResult:
        readers, borrowed = waiter.readers, waiter.borrowed
        now = time.time()
        handoff = None
        finish = None if out.finish_reason == FinishReason.PREFILL_DONE else out.finish_reason
        if finish is None:
            pre = self.engine.prefilled(out.request_id)
            descriptor = self.exporter.export(out.request_id, pre.block_ids, pre.num_kv_tokens, readers[0])
            self.ledger.opened(out.request_id, descriptor.transfer_id)
            shards: tuple[KVDescriptor, ...] = ()
            if self.tp.size > 1:
                shards = self._export_shards(out.request_id, pre.block_ids, pre.num_kv_tokens, readers)
            handoff = KVHandoff(self.worker_id, (descriptor, *shards))
        return PrefillResult(
            request_id=out.request_id,
            worker_id=self.worker_id,
            output_token_ids=list(out.new_token_ids),
            text=out.text,
            logprobs=list(out.new_logprobs),
            top_logprobs=list(out.new_top_logprobs),
            prompt_logprobs=out.prompt_logprobs,
            token_time=now,
            finish_reason=finish,
            num_cached_tokens=out.num_cached_tokens,
            handoff=handoff,
            scheduled_at=out.scheduled_at,
            pulled_tokens=borrowed.pulled_tokens if borrowed is not None else 0,
            pulled_from=borrowed.holder_id if borrowed is not None and borrowed.pulled_tokens else "",
        )

    def _export_shards(
        self, request_id: str, block_ids: list[int], num_tokens: int, readers: tuple[int, ...]
    ) -> tuple[KVDescriptor, ...]:
        """Every other TP rank exports its heads of the same blocks (``readers[r]``: the
        decode ranks that read rank r's). If one fails, all shards and rank 0's own
        export are released and the error is raised."""
        self.tp.broadcast_object(ExportShard(request_id, block_ids, num_tokens, readers))
        replies = self.tp.gather_object(None)
        failed = next((d for d in replies[1:] if isinstance(d, Exception)), None)
        if failed is not None:
            self.tp.broadcast_object(ReleaseShard(request_id))
            self._abort(request_id)  # rank 0's own export
            raise KVTransferError(str(failed))
        self.ledger.shards_opened(request_id, range(1, self.tp.size))
        return tuple(replies[1:])

    def _on_tick(self) -> None:
        """Lease ends (the poller's, and the other ranks') into the ledger; the blocks of
        every request whose leases have all ended go back to the engine."""
        self._heartbeats.tick()  # idle ranks must hear from rank 0 within the group's timeout
        while not self._ended.empty():
            end = self._ended.get_nowait()
            if self.ledger.ended(end):  # rank 0's lease expired or was released: the others' go too
                self.tp.broadcast_object(ReleaseShard(end.request_id))
        if self.ledger.shards_open:
            self.tp.broadcast_object(PollShards())
            for rank, ended in enumerate(self.tp.gather_object(None)):
                self.ledger.shards_ended(rank, ended or ())
        for request_id in self.ledger.take_released():
            try:
                self.engine.release(request_id)
            except UnknownRequest:  # already aborted, or already released
                pass
