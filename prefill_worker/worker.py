"""The prefill worker: an engine that only prefills, and a KV source that ships
what it computed.

A request's life here (the engine batches prompts up to its token budget and
chunks long ones)::

    prefill(task) --add_request(prefill_only)--> WAITING/RUNNING in the engine
        --first token sampled--> PREFILLED --export--> EXPORTED (a lease; ExportLedger)
        --decode worker confirms | lease expires | abort()--> blocks released

A decode worker confirms through the backend's own channel (nixl, torch_dist, ucx),
or calls ``confirm`` right after its pull (ray); either way the blocks are freed at
the pull: the source reports the lease's end (``kv_transfer.polling``), the ledger
says every rank's lease ended (``kv_transfer.exports``), and the engine thread
releases the blocks on its next tick. A cancelled or timed-out ``prefill`` aborts
its request, so no path leaves blocks behind.

Each layer is hashed as the forward pass writes it (``LayerExporter``), so the
export only publishes. With ``spec.stream_kv`` (a backend that streams, TP=1) the
export opens as the prompt's last step begins, and ``prefill_stream`` yields its
handoff at once, so the decode worker pulls layer k while layer k+1 computes::

    prefill_stream(task) -> PrefillAccepted         the engine took the request
                         -> KVStreaming(handoff)   the last step's forward pass begins
                         -> PrefillResult           first token sampled (same handoff)

Prefixes between prefill workers (TP=1): a task whose ``prefix_from`` names
another prefill worker first copies the prompt's leading blocks from it
(``prefill_worker.borrow``) and computes only the rest, or everything if the copy
fails; ``lend_prefix`` is the other side, an export of cached blocks under a lease.

With ``spec.tp`` set the worker is rank 0 of a tensor-parallel group of
``PrefillRank``s (``prefill_worker.tp``); each result also carries every other
rank's KV shard. The class imports no Ray: ``cluster`` wraps it with
``ray.remote`` (an asyncio actor); tests drive it with plain asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator

from splitserve.engine.engine import Engine
from splitserve.engine.loop import EngineLoop
from splitserve.engine.parallel.worker_group import Heartbeats
from splitserve.engine.text import Texts, with_text_failures
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.exports import ExportLedger, lend
from splitserve.kv_transfer.layerwise import LayerExporter
from splitserve.kv_transfer.polling import SourcePoller
from splitserve.kv_transfer.puller import KVPuller
from splitserve.kv_transfer.tp_mapping import RankSink
from splitserve.prefill_worker.borrow import PrefixBorrower
from splitserve.prefill_worker.tp import OtherRanks, ReaderCounts, join_prefill_group
from splitserve.prefill_worker.waiter import Waiter, first_text
from splitserve.wire.engine_commands import (
    Abort,
    AddRequest,
    LendPrefix,
    LoadAdapter,
    Snapshot,
    UnloadAdapter,
)
from splitserve.wire.errors import EngineStopped, InvalidRequest, KVTransferError, UnknownRequest
from splitserve.wire.faults import ArmedFault, ArmedFaults
from splitserve.wire.kv import Confirmation, KVDescriptor, KVHandoff, Leases
from splitserve.wire.outputs import PrefilledRequest, RequestOutput
from splitserve.wire.prefill import (
    KVStreaming,
    PrefillAccepted,
    PrefillEvent,
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

PREFILL = "prefill"  # the name of this worker, the lender of its KV, on its engine loop


class PrefillWorker:
    def __init__(self, spec: PrefillWorkerSpec, loop: EngineLoop | None = None):
        """``loop``: an engine loop shared with another half of the same worker (an
        ``ElasticWorker``: TP=1), whose owner routes its callbacks here and starts it;
        without one, the worker builds its own engine and starts."""
        if spec.tp is not None and spec.tp.rank != 0:
            raise ValueError("a PrefillWorker is rank 0 of its TP group; the others are PrefillRanks")
        self.spec = spec
        self.worker_id = spec.worker_id
        self.tp = join_prefill_group(spec)
        self.loop = loop or EngineLoop.for_worker(
            spec.worker_id, spec.engine, self.tp, self.on_outputs, self.tick, self.on_error
        )
        self.engine = self.loop.build()
        compat = self.engine.kv_compat()
        backend = get_backend(spec.backend)
        self.source = backend.source(spec.worker_id, self.engine.kv_cache.tensor, compat, spec.lease_s)
        self.handshakes = tuple(self.tp.gather_object(self.source.handshake()))  # every rank's
        self._readers = ReaderCounts(self.tp.size, self.engine.model_config.num_kv_heads)
        self._waiters: dict[str, Waiter] = {}  # requests whose prefill() is awaiting
        self._texts = Texts(self.engine.tokenizer)  # their first tokens' text (engine thread)
        self._text_failures = 0  # requests failed because that text could not be made
        self.ledger = ExportLedger()  # what is held under a lease (engine thread only)
        self.shards = OtherRanks(self.tp, self.ledger)  # the other TP ranks' exports
        self._heartbeats = Heartbeats(self.tp, spec.tp)
        self._source_lock = threading.Lock()
        self._faults = ArmedFaults(spec.worker_id, ("source",))  # a harness's, after an export
        self.streams_kv = spec.stream_kv and self.source.streams and self.tp.size == 1
        # hashes each layer as prefill writes it (a TP group's other ranks: theirs at export)
        self.exporter = LayerExporter(
            self.source,
            stream=self.streams_kv,
            lock=self._source_lock,
            on_stream=self._on_stream,
            readers=self._stream_readers,
        )
        self.borrower: PrefixBorrower | None = None  # pulls prefixes from other prefill workers
        self.puller: KVPuller | None = None  # what the borrower pulls them with
        if self.tp.size == 1:
            self.engine.observe_layers(self.exporter)
            # a loan's ids at most (a grouped layout's windows too: KVLayout.most_ids)
            most = compat.layout.most_ids(-(-self.engine.max_model_len // spec.engine.block_size))
            sink = RankSink(
                f"{spec.worker_id}/borrow", self.engine.kv_cache.tensor, compat, backend.sink, most
            )
            self.puller = KVPuller(spec.worker_id, sink, (), None)
            submit = lambda command: asyncio.wrap_future(self.loop.submit(command))  # noqa: E731
            bs, timeout = spec.engine.block_size, spec.transfer_timeout_s or spec.lease_s
            self.borrower = PrefixBorrower(spec.worker_id, self.puller, bs, submit, timeout)
        # before the loop starts: its first tick takes the lease ends the poller reported
        self._poller = SourcePoller(self.source, self._source_lock, f"{spec.worker_id}-kv-poll")
        self.loop.add_lender(PREFILL, self)
        if loop is None:
            self.loop.start()

    # ---- called by the router (asyncio) ------------------------------------------
    async def info(self) -> PrefillWorkerInfo:
        return PrefillWorkerInfo(
            self.worker_id,
            self.engine.validator,
            self.handshakes,
            self.engine.summary,
            self.streams_kv,
            self.engine.capacity.bytes_per_token,
            self.engine.revision,
        )

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Prefill ``task`` and export its KV. Raises ``InvalidRequest`` for bad
        input, ``DeadlineExceeded`` past ``task.timeout_s``."""
        async with self._prefilling(task, stream=False) as waiter:
            return await waiter.within(task, waiter.future)

    async def prefill_stream(self, task: PrefillTask) -> AsyncIterator[PrefillEvent]:
        """As ``prefill``: ``PrefillAccepted`` once the engine has the request, the
        ``PrefillResult`` last; before it, where this worker streams KV
        (``info().streams_kv``), a ``KVStreaming`` as the prompt's last prefill step begins,
        unless that step has ended when this coroutine wakes (then the KV goes whole). Its
        lease runs from then; a caller that leaves before the result releases it."""
        async with self._prefilling(task, stream=self.streams_kv) as waiter:
            yield PrefillAccepted(task.request_id)
            if waiter.streamed is not None:
                either = asyncio.wait([waiter.streamed, waiter.future], return_when=asyncio.FIRST_COMPLETED)
                await waiter.within(task, either)
                if waiter.streamed.done() and not waiter.future.done():
                    yield KVStreaming(task.request_id, waiter.streamed.result())
            result = await waiter.within(task, waiter.future)
        yield result  # outside: a caller that leaves now must not release what it was handed

    @contextlib.asynccontextmanager
    async def _prefilling(self, task: PrefillTask, stream: bool) -> AsyncIterator[Waiter]:
        """Add ``task`` to the engine and wait for it inside; leaving early (an error, a
        cancel, the deadline) aborts it here, with whatever it holds."""
        rid = task.request_id
        if rid in self._waiters:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        loop = asyncio.get_running_loop()
        deadline = None if task.timeout_s is None else loop.time() + task.timeout_s
        readers = self._readers.of(task.reader_tp)
        streamed = loop.create_future() if stream else None
        waiter = Waiter(loop, loop.create_future(), streamed, deadline, readers)

        self._waiters[rid] = waiter  # before the engine sees the request: no output is missed
        try:
            if task.prefix_from is not None and self.borrower is not None:
                waiter.borrowed = await self.borrower.borrow(task)
            borrowed = waiter.borrowed  # adopted in the same call: the prompt finds them cached
            adopt = None if borrowed is None else (borrowed.loan_id, borrowed.num_blocks)
            add = AddRequest(
                rid,
                task.prompt_token_ids,
                task.params,
                prefill_only=True,
                export_from_block=task.export_from_block,
                adopt=adopt,
            )
            try:  # raises InvalidRequest, e.g. for an id still held here
                await asyncio.wrap_future(self.loop.submit(add))
            except BaseException:
                if borrowed is not None:  # not adopted if add never ran (idempotent)
                    self.loop.submit(Abort(borrowed.loan_id))
                raise
            try:
                yield waiter
            except BaseException:  # deadline, cancel, or the caller left: it will not take the KV
                self._abort_later(rid)
                raise
        finally:
            self._waiters.pop(rid, None)

    def _stream_readers(self, request_id: str) -> int:  # engine thread
        """The readers of a streamed export (TP=1 here: rank 0's count)."""
        waiter = self._waiters.get(request_id)
        return waiter.readers[0] if waiter is not None else 1

    async def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` wherever it is here: queued, prefilling, or exported
        and waiting for a decode worker (its lease is released). Idempotent."""
        return await asyncio.wrap_future(self.loop.submit(Abort(request_id, PREFILL)))

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        """Export the cached blocks of ``loan`` this worker holds from ``loan.from_block``
        on (``Engine.lend_prefix``), under a lease like a prefill's: the borrower's
        confirmation, ``abort(loan.request_id)`` or the lease's end frees them. None
        when it holds none of them, or is a TP group (whose ranks would each lend a
        shard; not done)."""
        if self.tp.size > 1:
            return None
        return await asyncio.wrap_future(self.loop.submit(LendPrefix(loan, PREFILL)))

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
            self.loop.call(lambda e: self.shards.confirm(shards))

    async def change_adapters(self, change: LoadAdapter | UnloadAdapter) -> str | None:
        """Load a LoRA adapter (its digest) or unload one: ``Engine.load_adapter``, ``unload_adapter``."""
        return await asyncio.wrap_future(self.loop.submit(change))

    async def arm_fault(self, armed: ArmedFault) -> None:
        """Inject a harness's fault into the export of a request yet to come
        (``wire.faults``: its bytes changed after they were hashed, before the pull)."""
        self._faults.arm(armed)

    async def stats(self, prefix_since: PrefixCursor | None = None) -> PrefillStats:
        """Load and lease figures, and the prefix cache's changes since ``prefix_since``."""
        engine, prefix, leases = await asyncio.wrap_future(self.loop.submit(Snapshot(prefix_since, PREFILL)))
        return PrefillStats(
            self.worker_id,
            with_text_failures(engine, self._text_failures),
            leases.held,
            leases_confirmed=leases.confirmed,
            leases_expired=leases.expired,
            leases_released=leases.released,
            prefix=prefix,
            prefix_pulls=self.borrower.pulls if self.borrower is not None else 0,
            prefix_pull_failures=self.borrower.failures if self.borrower is not None else 0,
        )

    def shutdown(self) -> None:
        self._poller.stop()
        self.loop.stop()
        if self.loop.error is None:
            self.engine.stop_followers()
        with self._source_lock:
            self.source.close()
        if self.puller is not None:
            self.puller.close()
        self.tp.destroy()

    # ---- the engine loop thread ----------------------------------------------------
    def _abort_later(self, request_id: str) -> None:
        self.loop.submit(Abort(request_id, PREFILL))

    def on_error(self, error: BaseException) -> None:
        """The engine loop died (a bug, or a lost TP rank): fail every waiting request now."""
        for waiter in list(self._waiters.values()):
            waiter.resolve(error=EngineStopped(f"prefill worker {self.worker_id} stopped: {error}"))

    def lend(self, engine: Engine, request_id: str, kv: PrefilledRequest) -> KVHandoff:
        """Export PREFILLED ``request_id``'s KV as ``kv`` names it under a lease (``LendPrefix``
        through this lender, ``"prefill"``); its blocks are released if that fails."""
        release = lambda: engine.release(request_id)  # noqa: E731
        desc = lend(self.source, self._source_lock, self.ledger, request_id, kv, release)
        return KVHandoff(self.worker_id, (desc,), kv.adapter_digest)

    def leases(self) -> Leases:
        return self.ledger.leases()

    def release(self, engine: Engine, request_id: str) -> bool:
        """Release ``request_id``'s export if its lease is open (whether it was): a later
        tick frees its blocks (and tells the other ranks to release their shards)."""
        transfer_id = self.ledger.transfer(request_id)
        if transfer_id is None:
            return False
        with self._source_lock:
            self.source.release(transfer_id)
        return True

    def _on_stream(self, descriptors: list[KVDescriptor]) -> None:
        """A step begins whose forward pass completes these prompts, and their exports
        stream (before the pass): abort releases them from now on, and a
        ``prefill_stream`` caller gets its handoff."""
        for desc in descriptors:
            self.ledger.opened(desc.request_id, desc.transfer_id)
            waiter = self._waiters.get(desc.request_id)
            if waiter is not None:
                digest = self.engine.adapter_digest(desc.request_id)
                waiter.announce(KVHandoff(self.worker_id, (desc,), digest))

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Prefilled requests (engine thread): each has its first token's text made
        (``engine.text``; a stop string may end it there), then its KV exported and its
        caller answered; the KV of one nobody will take goes back to the engine."""
        for out in outputs:
            if not out.finished:
                continue
            rid = out.request_id
            waiter = self._waiters.get(rid)
            held = out.finish_reason == FinishReason.PREFILL_DONE  # the engine keeps its KV
            error = out.error  # it failed alone in the engine (which freed its blocks)
            if waiter is not None and error is None:
                error = first_text(self._texts, out)
                self._text_failures += error is not None
            exporting = (
                waiter is not None and error is None and out.finish_reason == FinishReason.PREFILL_DONE
            )
            if not exporting:
                self.exporter.discard(rid)  # nothing will be exported
                if held:  # its caller is gone, or it ended at its first token's text
                    with contextlib.suppress(UnknownRequest):
                        self.engine.release(rid)
            if waiter is None:
                continue
            if error is not None:
                waiter.resolve(error=error)
                continue
            try:
                handoff = self._export(out, waiter.readers) if exporting else None
                waiter.resolve(waiter.result(out, self.worker_id, self.engine.revision, handoff))
            except Exception as e:  # export failed: give the blocks back, tell the caller
                log.exception("exporting the KV of %s failed", rid)
                self.exporter.discard(rid)  # what it hashed (or began streaming) for it
                with contextlib.suppress(UnknownRequest):  # it may be gone already
                    self.engine.release(rid)
                waiter.resolve(error=e)

    def _export(self, out: RequestOutput, readers: tuple[int, ...]) -> KVHandoff:
        """Export a prefilled request's KV: rank 0's, and in a TP group every other rank's
        shard of the heads (``readers[r]``: the decode ranks that read rank r's). If a
        shard fails, every export of the request is released and the error raised."""
        rid, pre = out.request_id, self.engine.prefilled(out.request_id)
        descriptor = self.exporter.export(rid, pre.block_ids, pre.num_kv_tokens, readers[0], pre.window_from)
        self.ledger.opened(rid, descriptor.transfer_id)
        if (fault := self._faults.take(rid, "source")) is not None:
            with self._faults.injecting(rid, fault):
                self.engine.inject_fault(rid, fault)
        try:
            shards = self.shards.export(rid, pre.block_ids, pre.num_kv_tokens, readers, pre.window_from)
        except KVTransferError:
            self.release(self.engine, rid)  # rank 0's own export
            raise
        return KVHandoff(self.worker_id, (descriptor, *shards), pre.adapter_digest)

    def tick(self) -> None:
        """Lease ends (the poller's, and the other ranks') into the ledger; the blocks of
        every request whose leases have all ended go back to the engine."""
        self._heartbeats.tick()  # idle ranks must hear from rank 0 within the group's timeout
        for end in self._poller.ended():
            if self.ledger.ended(end):  # rank 0's lease expired or was released: the others' go too
                self.shards.release(end.request_id)
        self.shards.poll()
        for request_id in self.ledger.take_released():
            try:
                self.engine.release(request_id)
            except UnknownRequest:  # already aborted, or already released
                pass
