"""The decode worker: takes requests prefilled on a prefill worker (which it calls
itself, pulling the KV) or whole ones, runs them in one continuous batch, and
streams their tokens.

A consumer (the router) reads one ``stream(outbox_id)`` per worker and starts
requests on it with ``start(outbox_id, task)``; every engine step's tokens of
all its requests come back as one item (``decode_worker.outbox``). Across
processes the stream is read over gRPC at ``token_address()``
(``decode_worker.token_server``), not through Ray: it is the hot path.

A request's life here (the queues SGLang's decode side names)::

    start(outbox, task) with a source (a prefill worker, task.source):
        -> hold_prefix: the prompt's leading full blocks this engine holds (its cache,
           its host tier) are taken for it; the source exports only the blocks
           after them (PrefillTask.export_from_block)
        -> PREFILLING: source.prefill_stream(prompt); lost before any KV came:
           PrefillLost (nothing is held anywhere; the router may try another)
        -> the handoff (KVStreaming as the prompt's last step begins, where the
           source streams; else with the result)
        -> linked: the source's handshakes, fetched once per source incarnation
           (source.info); a source that restarted since it exported: PeerLost
        -> WAITING_FOR_BLOCKS: the FIFO AdmissionQueue (decode_worker.admission)
        -> PULLING: import_request (the rest's blocks allocated) + a RankSink pull on the
           transfer thread of every TP rank here (verified; from a source group of
           another TP size, heads mapped by HeadMappingSink), confirmed to the
           source where the backend cannot confirm by itself (source.confirm)
        meanwhile the first token (the PrefillResult) goes out at once, as a
        TokenBatch with ``prefilled``; then a batch with the pull's transfer_s
        -> activate --RUNNING in the batch-- tokens --> finished
    start(outbox, task) without one (colocated, a short prompt by policy, a request
    resumed or recomputed):
        add_request (InvalidRequest raised by start) --WAITING/RUNNING-- tokens --> finished

``start`` returns once the request is accepted; everything after ends in the
outbox, as tokens and a last batch with ``finish_reason`` or with ``error``
(``PrefillLost``, ``Overloaded``, ``KVTransferError``, ``DeadlineExceeded``
past ``task.timeout_s``, or what the prefill worker raised). ``abort`` ends a
request early and frees its blocks; a pull in flight is first allowed to end (it
is bounded by ``transfer_timeout_s``), because its bytes are still landing in
those blocks. A request that ends before its transfer was confirmed releases
the source's export (``source.abort``). When a stream's consumer goes (closes
it, or dies), every request of its outbox is aborted.

With ``spec.tp`` set the worker is rank 0 of a tensor-parallel group whose other
ranks are ``DecodeRank``s (``splitserve.decode_worker.tp`` describes the
protocol): its steps drive theirs, each pull runs on every rank at once (each
pulling its own KV heads into the same blocks), and if the group breaks every
request ends with ``WorkerLost``. An expert-parallel group (``engine.ep_size``) is
the same group, but each rank caches its own sequences (attention data-parallel):
a request's pull runs on the one rank whose share of the blocks holds it
(``_holders``), into its own block ids.

The class imports no Ray: ``cluster`` wraps it with ``ray.remote``, the source is
whatever client the router put in the task, and the other ranks whatever
clients the pool gave the constructor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from splitserve.decode_worker.admission import AdmissionQueue, AdmissionState
from splitserve.decode_worker.outbox import Outbox
from splitserve.decode_worker.token_server import TokenServer
from splitserve.decode_worker.tp import join_decode_group, rank_sink
from splitserve.engine.engine import Engine
from splitserve.engine.loop import EngineLoop
from splitserve.engine.parallel.worker_group import Heartbeats
from splitserve.wire.background import Background
from splitserve.wire.decode import (
    DecodeRankPeer,
    DecodeStats,
    DecodeTask,
    DecodeWorkerInfo,
    DecodeWorkerSpec,
    Prefilled,
    TokenBatch,
)
from splitserve.wire.errors import (
    DeadlineExceeded,
    InvalidRequest,
    LeaseExpired,
    Overloaded,
    PeerLost,
    PrefillLost,
    WorkerLost,
)
from splitserve.wire.kv import Confirmation, KVHandoff
from splitserve.wire.outputs import RequestOutput
from splitserve.wire.prefill import KVStreaming, PrefillPeer, PrefillResult, PrefillTask
from splitserve.wire.prefix import PrefixCursor

log = logging.getLogger(__name__)

# A decode worker that takes KV from elsewhere measures its prompt rate on a prompt of this
# many tokens, and its decode step time, before its first request: the router's decider
# needs both to judge a prefill here (its cost, and the stall budget in decode steps).
# Without them it would go by the prefill pool's rate, measured on other prompts (long ones,
# slower per token), and allow no stall, which can keep every prompt away from here for good.
RATE_PROBE_TOKENS = 128


@dataclass(eq=False)
class _Request:
    """A request started here and not yet ended. On the actor's loop."""

    request_id: str
    outbox: Outbox
    deadline: asyncio.TimerHandle | None = None  # ends it with DeadlineExceeded
    importing: asyncio.Task | None = None  # prefill on the source, admission, pull
    state: AdmissionState | None = None  # an imported request's, from the admission queue on


class DecodeWorker:
    def __init__(self, spec: DecodeWorkerSpec, ranks: Sequence[DecodeRankPeer] = ()):
        """``ranks``: with ``spec.tp`` set (this is rank 0 of a TP group) and a backend, the
        group's other ranks, in rank order, which pull their KV heads of each request."""
        if spec.tp is not None and spec.tp.rank != 0:
            raise ValueError("a DecodeWorker is rank 0 of its TP group; the others are DecodeRanks")
        group_size = spec.tp.size if spec.tp is not None else 1
        if spec.backend is not None and len(ranks) != group_size - 1:
            raise ValueError(f"a TP group of {group_size} takes KV through {group_size - 1} other ranks")
        self.spec = spec
        self.worker_id = spec.worker_id
        self.ranks = tuple(ranks)
        self.tp = join_decode_group(spec)
        self._heartbeats = Heartbeats(self.tp, spec.tp)
        # the engine is built on the loop's thread, the one that steps it (engine/loop.py says why)
        self.loop = EngineLoop(
            lambda: Engine(spec.engine, tp=self.tp),
            self._on_outputs,
            self._heartbeats.tick,  # idle ranks must hear from rank 0 within the group's timeout
            name=f"{spec.worker_id}-engine",
            on_error=self._on_error,
        )
        self.engine = self.loop.build()
        # Pulls this rank's KV heads from any source group (its staging caches for sources of
        # another TP size hold one request of max_model_len per source rank, for good).
        self.sink = rank_sink(spec.worker_id, spec, self.engine)
        # prefill worker id -> the source incarnations (one per TP rank) whose handshakes every
        # rank's sink holds. Written on the actor's event loop after the link finished.
        self._peers: dict[str, tuple[str, ...]] = {}
        self._linking: dict[str, asyncio.Lock] = {}  # by prefill worker id: one link at a time
        self._background = Background()  # confirmations and releases to sources, not awaited
        self._admission: AdmissionQueue | None = None  # made on the actor's loop
        self._aloop: asyncio.AbstractEventLoop | None = None  # the actor's loop, once a request came
        # One thread drives the sink (it is not thread-safe); pulls overlap decode steps.
        self._transfer = ThreadPoolExecutor(1, thread_name_prefix=f"{spec.worker_id}-kv")
        self._outboxes: dict[str, Outbox] = {}  # by outbox id (one per consumer)
        self._requests: dict[str, _Request] = {}  # started and not yet ended
        self._tokens: TokenServer | None = None  # serves stream() over gRPC, from token_address()
        self.loop.start()
        if self.sink is not None:  # before any request (its outputs reach no outbox)
            self.loop.call(lambda e: e.measure_rates(RATE_PROBE_TOKENS)).result()

    # ---- called by the router (asyncio) ------------------------------------------
    async def info(self) -> DecodeWorkerInfo:
        return DecodeWorkerInfo(
            self.worker_id,
            self.engine.validator,
            colocated=self.sink is None,
            engine=self.engine.summary,
            kv_bytes_per_token=self.engine.capacity.bytes_per_token,
        )

    async def token_address(self) -> str:
        """Where ``stream`` and ``start`` are served over gRPC (``wire.token_stream``),
        started on the first call, on this actor's loop: a router starts its requests and
        reads their tokens there rather than through Ray."""
        if self._tokens is None:
            tokens = TokenServer(self.stream, self.start)
            await tokens.start()
            self._tokens = tokens
        return self._tokens.address

    async def stream(self, outbox_id: str) -> AsyncIterator[tuple[TokenBatch, ...]]:
        """The batches of the requests started on ``outbox_id``, every step's as one item
        (one ``TokenBatch`` per request that has news). Runs until the consumer closes
        it; then every request of the outbox still running is aborted."""
        outbox = self._outbox(outbox_id)
        if outbox.reading:
            raise InvalidRequest(f"outbox {outbox_id!r} already has a reader")
        outbox.reading = True
        try:
            while True:
                yield await outbox.take()
        finally:
            for rid in list(outbox.requests):
                self._end(rid)
            self._outboxes.pop(outbox_id, None)

    async def start(self, outbox_id: str, task: DecodeTask) -> None:
        """Accept ``task``; its tokens and its end come through ``outbox_id``'s stream.
        Raises (holding nothing) ``InvalidRequest``."""
        rid = task.request_id
        if rid in self._requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        if task.source is not None:
            self._require_sink()
            if task.output_token_ids:
                raise InvalidRequest("a task prefilled elsewhere starts with no output tokens")
        self._aloop = loop = asyncio.get_running_loop()
        outbox = self._outbox(outbox_id)
        req = self._requests[rid] = _Request(rid, outbox)
        outbox.requests.add(rid)
        deadline = None
        if task.timeout_s is not None:
            deadline = time.monotonic() + task.timeout_s
            error = DeadlineExceeded(f"request {rid} ran past its {task.timeout_s:.3g} s")
            req.deadline = loop.call_at(loop.time() + task.timeout_s, self._fail, rid, error)
        if task.source is not None:
            req.importing = asyncio.ensure_future(self._take_over(task, deadline, req))
            return
        try:
            await self._call(
                lambda e: e.add_request(
                    task.prompt_token_ids, task.params, rid, output_token_ids=task.output_token_ids
                )
            )
        except BaseException:
            self._end(rid)
            raise

    async def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` and free its blocks (awaited); its batches not taken yet
        are dropped (the consumer stopped reading it). Idempotent."""
        req = self._requests.get(request_id)
        if req is not None:
            req.outbox.drop(request_id)
            importing = req.importing
            if importing is not None and not importing.done():
                self._end(request_id)  # the import frees the blocks once its pull is over
                await asyncio.wait([importing])
                return True
            self._end(request_id, abort=False)
        return await asyncio.wrap_future(self._abort_in_engine(request_id))

    async def stats(self, prefix_since: PrefixCursor | None = None) -> DecodeStats:
        """Load figures, and the prefix cache's changes since ``prefix_since``."""
        engine, prefix = await self._call(lambda e: (e.stats(), e.prefix_update(prefix_since)))
        states = [r.state for r in self._requests.values()]
        return DecodeStats(
            self.worker_id,
            engine,
            num_waiting_for_blocks=states.count(AdmissionState.WAITING_FOR_BLOCKS),
            num_pulling=states.count(AdmissionState.PULLING),
            prefix=prefix,
            peers=dict(self._peers),
        )

    def shutdown(self) -> None:
        self.loop.stop()
        if self.loop.error is None:
            self.engine.stop_followers()
        self._transfer.shutdown(wait=True)
        if self.sink is not None:
            self.sink.close()
        self.tp.destroy()

    # ---- internals ------------------------------------------------------------
    async def _call(self, fn):
        return await asyncio.wrap_future(self.loop.call(fn))

    def _outbox(self, outbox_id: str) -> Outbox:
        outbox = self._outboxes.get(outbox_id)
        if outbox is None:
            outbox = self._outboxes[outbox_id] = Outbox(outbox_id)
        return outbox

    def _end(self, rid: str, abort: bool = True) -> bool:
        """Forget request ``rid``; with ``abort``, free what it holds in the engine (an
        import in flight is cancelled and frees it once its pull is over). Returns
        whether the request was here."""
        req = self._requests.pop(rid, None)
        if req is None:
            return False
        req.outbox.requests.discard(rid)
        if req.deadline is not None:
            req.deadline.cancel()
        importing = req.importing
        if importing is not None and not importing.done() and importing is not asyncio.current_task():
            importing.cancel()
        elif abort:
            self._abort_in_engine(rid)
        return True

    def _fail(self, rid: str, error: Exception) -> None:
        """End ``rid`` with ``error``, the last batch its consumer gets."""
        req = self._requests.get(rid)
        if req is not None:
            req.outbox.put(TokenBatch(rid, [], "", [], [], None, 0, error=error))
            self._end(rid)

    def _require_sink(self) -> None:
        if self.sink is None:
            raise InvalidRequest(f"worker {self.worker_id} is colocated and takes no KV from elsewhere")

    def _abort_in_engine(self, request_id: str):
        """Abort on the engine thread; once its blocks are free, the admission queue's
        head is offered them. Returns the engine call's future."""
        future = self.loop.call(lambda e: e.abort(request_id))
        if self._admission is not None:
            future.add_done_callback(lambda _: self._admission.wake_threadsafe())
        return future

    async def _take_over(self, task: DecodeTask, deadline: float | None, req: _Request) -> None:
        """Prefill ``task`` on its source, pass the first token on, link, wait in the
        admission queue for blocks, pull and verify the KV, confirm it, activate (a task
        of its own). A failure ends the request with its error; cancelled (abort,
        deadline), it frees the blocks once the pull is over. Either way, an export not
        yet confirmed is released on the source."""
        rid, source = task.request_id, task.source
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        pull = first_token = None
        exported = confirmed = ended = False
        try:
            # the prompt's leading blocks this worker holds stay held; only the rest moves
            held = await self._call(lambda e: e.hold_prefix(rid, task.prompt_token_ids, task.params))
            # the source maps KV heads to a group of tp_size readers (under EP one rank reads it all)
            prefill = PrefillTask(
                rid,
                task.prompt_token_ids,
                task.params,
                left,
                reader_tp=self.spec.engine.tp_size,
                export_from_block=held // self.spec.engine.block_size,
                prefix_from=task.prefix_from,
            )
            async with contextlib.aclosing(source.prefill_stream(prefill)) as events:
                try:
                    first = await self._prefill_event(events, rid, kv_began=False)
                    exported, handoff, exported_at = True, first.handoff, time.time()
                    if isinstance(first, PrefillResult):
                        self._pass_on(req, first, exported_at, streamed=False)
                        first_token = asyncio.get_running_loop().create_future()
                        first_token.set_result(first)
                    else:
                        first_token = asyncio.ensure_future(
                            self._first_token(events, req, handoff, exported_at)
                        )
                    if handoff is None:  # it ended at its first token: nothing to take
                        confirmed = True
                        self._end(rid)  # what it held here
                        return
                    await self._link(source, handoff)
                    if self._admission is None:
                        self._admission = AdmissionQueue(self.worker_id, self.spec.max_admission_queue)

                    async def allocate() -> list[int] | None:
                        try:
                            return await self._call(
                                lambda e: e.import_request(rid, task.prompt_token_ids, [], task.params)
                            )
                        except Overloaded:
                            return None

                    req.state = AdmissionState.WAITING_FOR_BLOCKS
                    blocks = await self._admission.admit(rid, allocate, deadline, handoff.remaining_lease())
                    req.state = AdmissionState.PULLING
                    t0 = time.perf_counter()
                    timeout = self.spec.transfer_timeout_s
                    if deadline is not None:
                        timeout = max(0.001, min(timeout, deadline - time.monotonic()))
                    pull = asyncio.ensure_future(self._pull(handoff, blocks, timeout))
                    confirmations, waited = await asyncio.shield(pull)
                    pulled = time.perf_counter() - t0 - waited  # not the time the source took to compute
                    if handoff.remaining_lease() <= 0:
                        raise LeaseExpired(f"the KV lease of request {rid} ran out")
                    undelivered = tuple(c for c in confirmations if not c.delivered)
                    if undelivered:
                        self._background.run(source.confirm(undelivered))
                    confirmed = True
                    result = await first_token
                except Exception:
                    if first_token is not None and not first_token.done():
                        # the handover failed: the source's first token, when it comes, still
                        # goes out first (the request is recomputed after it)
                        await asyncio.wait([first_token])
                    raise
                finally:
                    if first_token is not None and not first_token.done():
                        first_token.cancel()  # before the stream it reads closes
                        await asyncio.wait([first_token])
                    ended = _ended_at_first_token(first_token)
            if result.finish_reason is not None:  # it ended at its first token, after all
                self._end(rid)
                return
            # Reported before activation, so that it reaches the consumer before any token.
            req.outbox.put(TokenBatch(rid, [], "", [], [], None, 0, pulled, started_at=time.time()))
            await self._call(lambda e: e.activate(rid, result.output_token_ids))
            req.state = AdmissionState.RUNNING
        except asyncio.CancelledError:  # ended by abort or deadline
            if pull is not None:
                with contextlib.suppress(BaseException):
                    await pull  # bytes may still be landing in the blocks: free them only after
            self._abort_in_engine(rid)
            if exported and not confirmed:
                self._background.run(source.abort(rid))
            raise
        except Exception as e:
            if exported and not confirmed:
                self._background.run(source.abort(rid))
            if ended:  # the consumer has its end already: this request only frees its blocks
                self._end(rid)
            else:
                self._fail(rid, e)

    @staticmethod
    async def _prefill_event(events, rid: str, kv_began: bool) -> KVStreaming | PrefillResult:
        """The source's next event. Lost (or its stream ended early) before any KV came,
        ``PrefillLost``; after, ``PeerLost`` (the KV will not be whole)."""
        try:
            item = await anext(events, None)
        except WorkerLost as e:
            item, why = None, str(e)
        else:
            why = "it ended its stream without a result"
        if item is None or (kv_began and not isinstance(item, PrefillResult)):
            if kv_began:
                raise PeerLost(f"the prefill worker of request {rid} was lost while its KV streamed: {why}")
            raise PrefillLost(f"the prefill worker of request {rid} was lost before its KV came: {why}")
        return item

    async def _first_token(
        self, events, req: _Request, handoff: KVHandoff, exported_at: float
    ) -> PrefillResult:
        """A streaming source's result, after its handoff: its first token goes out now."""
        result = await self._prefill_event(events, req.request_id, kv_began=True)
        self._pass_on(req, result, exported_at, streamed=True, handoff=handoff)
        return result

    def _pass_on(
        self,
        req: _Request,
        result: PrefillResult,
        exported_at: float,
        streamed: bool,
        handoff: KVHandoff | None = None,
    ) -> None:
        """The source's first token (and the end, if the request ended at it), to the consumer now."""
        handoff = handoff or result.handoff
        kv_bytes = handoff.num_bytes if handoff is not None else 0
        at = exported_at if handoff is not None else None
        prefilled = Prefilled(
            result.worker_id,
            result.scheduled_at,
            at,
            streamed,
            kv_bytes,
            result.pulled_tokens,
            result.pulled_from,
        )
        n = len(result.output_token_ids)
        req.outbox.put(
            TokenBatch(
                req.request_id,
                list(result.output_token_ids),
                result.text,
                list(result.logprobs),
                [result.token_time] * n,
                result.finish_reason,
                result.num_cached_tokens,
                prefilled=prefilled,
                top_logprobs=list(result.top_logprobs),
                prompt_logprobs=result.prompt_logprobs,
            )
        )

    async def _link(self, source: PrefillPeer, handoff: KVHandoff) -> None:
        """Hold the handshakes of ``handoff``'s source incarnations, fetching them from the
        source once per incarnation. ``PeerLost`` if it is gone or restarted since."""
        key = handoff.source_worker
        if self._peers.get(key) == handoff.incarnations:
            return
        async with self._linking.setdefault(key, asyncio.Lock()):
            if self._peers.get(key) == handoff.incarnations:
                return
            try:
                info = await source.info()
            except WorkerLost as e:
                raise PeerLost(f"prefill worker {key} is gone with this KV: {e}") from None
            handshakes = info.handshakes
            if tuple(hs.incarnation for hs in handshakes) != handoff.incarnations:
                raise PeerLost(f"prefill worker {key} restarted since it exported this KV")
            loop = asyncio.get_running_loop()
            own = loop.run_in_executor(self._transfer, self.sink.connect, list(handshakes))
            await _all_of(own, *(rank.link(handshakes) for rank in self.ranks))
            self._peers[key] = handoff.incarnations

    async def _pull(
        self, handoff: KVHandoff, blocks: list[int], timeout: float
    ) -> tuple[list[Confirmation], float]:
        """Under TP every rank pulls its KV heads of ``handoff`` into ``blocks`` at once;
        under EP the one rank whose share of the cache holds ``blocks`` pulls all the KV
        into its own block ids. Returns once all have ended (bytes may be landing in the
        blocks until then): every confirmation, and the seconds waited for a streamed
        source's layers. The first rank's error, if any, is raised after all have ended."""
        descs, loop = handoff.descriptors, asyncio.get_running_loop()
        pulls = [
            loop.run_in_executor(self._transfer, self.sink.pull, descs, ids, timeout)
            if rank == 0
            else self.ranks[rank - 1].pull(descs, ids, timeout)
            for rank, ids in self._holders(blocks)
        ]
        (confirmations, waited), *others = await _all_of(*pulls)
        return [c for cs, _ in ((confirmations, waited), *others) for c in cs], waited

    def _holders(self, blocks: list[int]) -> list[tuple[int, list[int]]]:
        """(rank, its block ids) of every rank that takes KV into ``blocks``: all of them,
        with the same ids, under TP; under EP the one rank holding them (its own ids)."""
        if self.spec.engine.ep_size == 1:
            return [(r, blocks) for r in range(1 + len(self.ranks))]
        return [self.engine.block_manager.locate(blocks)]  # any thread may call locate

    def _on_error(self, error: BaseException) -> None:  # engine thread
        """The engine loop died (a bug, or a lost TP rank): every request ends with
        ``WorkerLost`` (the router resumes it on another decode worker)."""
        if self._aloop is not None:
            lost = WorkerLost(f"decode worker {self.worker_id} stopped: {error}")
            self._aloop.call_soon_threadsafe(self._fail_all, lost)

    def _fail_all(self, error: Exception) -> None:  # the actor's loop
        for rid in list(self._requests):
            self._fail(rid, error)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:  # engine thread
        """One hand-over to the actor's loop per step, whatever the batch size."""
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._deliver, outputs, time.time())

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:  # the actor's loop
        finished = False
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:
                continue
            req.outbox.put(_batch(out, now))
            if out.finished:
                finished = True
                self._end(out.request_id, abort=False)
        if finished and self._admission is not None:
            self._admission.wake()  # blocks were freed


async def _all_of(*awaitables):
    """The results of ``awaitables`` once every one has ended, or else the first error
    among them once every one has ended: a failure does not leave the others running
    unwatched. Cancelling the caller cancels none of them (they run to their end)."""
    results = await asyncio.shield(asyncio.gather(*awaitables, return_exceptions=True))
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        raise error
    return results


def _ended_at_first_token(first_token: asyncio.Future | None) -> bool:
    """Whether the source's result came and ended the request (its exception, if any,
    is retrieved here)."""
    if first_token is None or first_token.cancelled() or first_token.exception() is not None:
        return False
    return first_token.result().finish_reason is not None


def _batch(out: RequestOutput, now: float) -> TokenBatch:
    return TokenBatch(
        request_id=out.request_id,
        token_ids=list(out.new_token_ids),
        text=out.text,
        logprobs=list(out.new_logprobs),
        top_logprobs=list(out.new_top_logprobs),
        prompt_logprobs=out.prompt_logprobs,
        token_times=[now] * len(out.new_token_ids),
        finish_reason=out.finish_reason if out.finished else None,
        num_cached_tokens=out.num_cached_tokens,
        started_at=out.scheduled_at,
        error=out.error,
    )
