"""The decode worker: takes requests prefilled on a prefill worker (which it calls
itself, pulling the KV) or whole ones, runs them in one continuous batch, and
streams their tokens.

A consumer (the router) reads one ``stream(outbox_id)`` per worker and starts
requests on it with ``start(outbox_id, task)``; every engine step's tokens of
all its requests come back as one item (``decode_worker.outbox``). Across
processes the stream is read over gRPC at ``token_address()``
(``decode_worker.token_server``), not through Ray: it is the hot path.

A request's life here::

    start(outbox, task) with a source (a prefill worker, task.source): a Handover
        (decode_worker.handover, its phases as SGLang's decode side names its queues)
        prefills it there, passes the first token on at once, links, waits in the
        admission queue (decode_worker.admission) for blocks, pulls the KV on every
        rank (kv_transfer.puller), confirms it, and activates it --RUNNING-- tokens
        --> finished
    start(outbox, task) without one (colocated, a short prompt by policy, a request
    resumed or recomputed):
        add_request (InvalidRequest raised by start) --WAITING/RUNNING-- tokens --> finished
    start(outbox, task) with task.moved (live migration, from another decode worker): a
        Migration (decode_worker.migration) links to that worker's KV source, waits for
        blocks, pulls the KV of the prompt and every token so far, confirms it and
        activates it --RUNNING-- tokens --> finished
    move_out(request_id) (the router moving it away): the engine suspends it between two
        steps and its KV is exported under a lease (decode_worker.mover); its batches end
        with one marked moved, after every token it made here
    precopy(PreCopy) (before a move here), lend_running (before a move away): the taker
        copies a running request's full blocks while it still decodes on the other
        worker (decode_worker.precopy), and the move exports only the blocks after them

``start`` returns once the request is accepted; everything after ends in the
outbox, as tokens and a last batch with ``finish_reason`` or with ``error``
(``PrefillLost``, ``Overloaded``, ``KVTransferError``, ``DeadlineExceeded``
past ``task.timeout_s``, or what the prefill worker raised). ``abort`` ends a
request early; a handover in flight frees what its phase holds (a pull in flight
is first allowed to end, its bytes still landing in the blocks; an export not
confirmed is released on the source). When a stream's consumer goes (closes it,
or dies), every request of its outbox is aborted.

With ``spec.tp`` set the worker is rank 0 of a tensor- (or expert-) parallel group
whose other ranks are ``DecodeRank``s; ``decode_worker.tp`` describes the protocol.
With ``spec.engine_process`` (colocated, one process) the engine runs in a process of
its own (``engine.process``): the worker holds its ``EngineFacts`` and sends commands.

The class imports no Ray: ``cluster`` wraps it with ``ray.remote``, the source is
whatever client the router put in the task, and the other ranks whatever
clients the pool gave the constructor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

from splitserve.decode_worker.admission import AdmissionQueue
from splitserve.decode_worker.handover import Handover, Phase
from splitserve.decode_worker.migration import Migration
from splitserve.decode_worker.mover import RequestMover
from splitserve.decode_worker.precopy import PreCopier
from splitserve.decode_worker.requests import RequestTable
from splitserve.decode_worker.side import WorkerSide
from splitserve.decode_worker.token_server import TokenServer
from splitserve.decode_worker.tp import join_decode_group, rank_sink
from splitserve.engine.facts import EngineFacts
from splitserve.engine.loop import EngineLoop
from splitserve.engine.parallel.worker_group import Heartbeats
from splitserve.engine.process import EngineProcess
from splitserve.engine.text import with_text_failures
from splitserve.kv_transfer.puller import KVPuller
from splitserve.wire.background import Background
from splitserve.wire.decode import (
    DecodeRankPeer,
    DecodeStats,
    DecodeTask,
    DecodeWorkerInfo,
    DecodeWorkerSpec,
    MovedRequest,
    PreCopy,
    RunningLoan,
    TokenBatch,
)
from splitserve.wire.engine_commands import (
    Abort,
    AddRequest,
    EngineCommand,
    LendPrefix,
    LendRunning,
    LoadAdapter,
    MeasureRates,
    MoveOut,
    Snapshot,
    UnloadAdapter,
    Withdraw,
)
from splitserve.wire.errors import InvalidRequest, UnknownRequest, WorkerLost
from splitserve.wire.faults import ArmedFault
from splitserve.wire.kv import Confirmation, KVHandoff
from splitserve.wire.outputs import RequestOutput, ThreadTimes
from splitserve.wire.prefill import PrefixLoan
from splitserve.wire.prefix import PrefixCursor

log = logging.getLogger(__name__)

# A decode worker that takes KV from elsewhere measures its prompt rate on a prompt of this many
# tokens, and its decode step time, before its first request: the router's decider judges a
# prefill here by both (without them: by the prefill pool's rate, on other prompts, and no stall).
RATE_PROBE_TOKENS = 128
MOVES = "moves"  # the name of the mover, this worker's lender, on its engine loop


class DecodeWorker:
    def __init__(
        self, spec: DecodeWorkerSpec, ranks: Sequence[DecodeRankPeer] = (), loop: EngineLoop | None = None
    ):
        """``ranks``: with ``spec.tp`` set (this is rank 0 of a TP group) and a backend, the
        group's other ranks, in rank order, which pull their KV heads of each request.
        ``loop``: an engine loop shared with another half of the same worker (an
        ``ElasticWorker``: TP=1), whose owner routes its callbacks here and calls
        ``start_engine``; without one, the worker builds its own engine and starts."""
        if spec.tp is not None and spec.tp.rank != 0:
            raise ValueError("a DecodeWorker is rank 0 of its TP group; the others are DecodeRanks")
        group_size = spec.tp.size if spec.tp is not None else 1
        if spec.backend is not None and len(ranks) != group_size - 1:
            raise ValueError(f"a TP group of {group_size} takes KV through {group_size - 1} other ranks")
        if spec.engine_process and (spec.backend or spec.tp or spec.engine.ep_size > 1 or loop is not None):
            raise ValueError("only a colocated worker of one process runs its engine in a process of its own")
        self.spec = spec
        self.worker_id = spec.worker_id
        self.ranks = tuple(ranks)
        self.tp = join_decode_group(spec)
        self._heartbeats = Heartbeats(self.tp, spec.tp)
        own = loop is None
        if spec.engine_process:  # the engine is not here (self.engine None), only its facts
            self.engine = None
            self.loop = EngineProcess(
                spec.worker_id, spec.engine, self.on_outputs, self.on_error, spec.torch_threads
            )
            self.facts = self.loop.build()
        else:
            self.loop = loop or EngineLoop.for_worker(
                spec.worker_id, spec.engine, self.tp, self.on_outputs, self.tick, self.on_error, paced=True
            )
            self.engine = self.loop.build()
            self.facts = EngineFacts.of(self.engine)
        # Pulls this rank's KV heads from any source group (its staging caches for sources of
        # another TP size hold one request of max_model_len per source rank, for good), and
        # has the other ranks pull theirs. None: colocated, it takes no KV from elsewhere.
        sink = rank_sink(spec.worker_id, spec, self.engine)
        locate = self.engine.locate if spec.engine.ep_size > 1 else None
        self.puller = None if sink is None else KVPuller(spec.worker_id, sink, self.ranks, locate)
        # The mover exports the KV of requests moved away (live migration), the pre-copier copies
        # that of requests moving here: on a worker of one process that takes KV (a group recomputes).
        self.mover = self.precopier = None
        if sink is not None and group_size == 1 and spec.engine.ep_size == 1:
            self.mover = RequestMover(spec.worker_id, self.engine, spec.backend, spec.lease_s)
            self.loop.add_lender(MOVES, self.mover)
            bs = spec.engine.block_size
            self.precopier = PreCopier(spec.worker_id, self.puller, bs, self._submit, spec.lease_s)
        self._background = Background()  # confirmations and releases to sources, not awaited
        # imported and moved-in requests wait here for blocks (on the actor's loop)
        self._admission = AdmissionQueue(spec.worker_id, spec.max_admission_queue)
        self._side: WorkerSide | None = None  # what its handovers ask of it (None: colocated)
        if self.puller is not None:
            parts = self._submit, self._admission, self.puller, self._abort_in_engine, self._background.run
            self._side = WorkerSide(spec, *parts)
        self._aloop: asyncio.AbstractEventLoop | None = None  # the actor's loop, once a request came
        # the requests started and not yet ended, their outboxes and their text
        self.requests = RequestTable(self._abort_in_engine, self.facts.tokenizer)
        self._tokens: TokenServer | None = None  # serves stream() over gRPC, from token_address()
        if own:
            self.start_engine()

    def start_engine(self) -> None:
        """Start stepping the engine (a shared loop's owner calls it once every half is
        set up), and measure the rates a decode worker that takes KV reports."""
        self.loop.start()
        if self.puller is not None:  # before any request (its outputs reach no outbox)
            self.loop.submit(MeasureRates(RATE_PROBE_TOKENS)).result()

    # ---- called by the router (asyncio) ------------------------------------------
    async def info(self) -> DecodeWorkerInfo:
        return DecodeWorkerInfo(
            self.worker_id,
            self.facts.validator,
            colocated=self.puller is None,
            engine=self.facts.summary,
            kv_bytes_per_token=self.facts.kv_bytes_per_token,
            revision=self.facts.revision,
            handshakes=(self.mover.handshake(),) if self.mover is not None else (),
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

    def stream(self, outbox_id: str) -> AsyncIterator[tuple[TokenBatch, ...]]:
        """The batches of the requests started on ``outbox_id``, every step's as one item
        (one ``TokenBatch`` per request that has news): an async generator that runs
        until the consumer closes it; then every request of the outbox still running is
        aborted (``RequestTable.stream``)."""
        return self.requests.stream(outbox_id)

    async def start(self, outbox_id: str, task: DecodeTask) -> None:
        """Accept ``task``; its tokens and its end come through ``outbox_id``'s stream.
        Raises (holding nothing) ``InvalidRequest``."""
        rid = task.request_id
        if rid in self.requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        if task.source is not None or task.moved is not None:
            self._require_sink()
            if task.output_token_ids:
                raise InvalidRequest("a task prefilled or moved elsewhere brings no output tokens of its own")
            if (task.moved is None) != (task.moved_from is None) or (task.moved and task.source):
                raise InvalidRequest("a moved request comes with the worker it moved from, and no source")
        self._aloop = asyncio.get_running_loop()
        if self.precopier is not None:  # a copy made ahead of its move is the move's now
            self.precopier.taken(rid)
        req = self.requests.add(rid, outbox_id, task.timeout_s)
        if task.source is not None or task.moved is not None:
            deadline = None if task.timeout_s is None else time.monotonic() + task.timeout_s
            way_in = Handover if task.source is not None else Migration
            req.handover = way_in(task, deadline, req.outbox, self._side)
            req.importing = asyncio.ensure_future(self.requests.run_way_in(req))
            return
        try:
            await self._submit(AddRequest(rid, task.prompt_token_ids, task.params, task.output_token_ids))
        except BaseException:
            self.requests.end(rid)
            raise

    async def move_out(self, request_id: str, export: bool = True, from_block: int = 0) -> MovedRequest:
        """Let go of ``request_id`` for another decode worker to take over (live migration):
        with ``export``, suspend it and export its KV after its first ``from_block``
        blocks (those the taker copied ahead: ``precopy``) (``decode_worker.mover``), held
        until the taker confirms it, ``abort`` releases it, or its lease ends; without,
        end it here (the taker recomputes it). Its batches here end with one marked
        ``moved``, after every token it generated here. Raises ``InvalidRequest`` where
        this worker cannot export requests (a TP group, colocated) or the request is still
        being prefilled or handed over, ``UnknownRequest`` when it is not here (it ended)."""
        if export and self.mover is None:
            raise InvalidRequest(f"worker {self.worker_id} cannot move requests with their KV")
        req = self.requests.get(request_id)
        if req is None:
            raise UnknownRequest(f"no request {request_id!r} runs on {self.worker_id}")
        if req.handover is not None and req.handover.phase != Phase.RUNNING:
            raise InvalidRequest(f"request {request_id} is still being handed over to {self.worker_id}")
        if export:
            moved = await self._submit(MoveOut(request_id, from_block, MOVES))
        else:
            outputs = await self._submit(Withdraw(request_id))
            moved = MovedRequest(request_id, self.worker_id, None, outputs, self.facts.revision)
        # every step's tokens reached the outbox before this call's result did (one FIFO loop)
        req.outbox.put(TokenBatch.moved_away(request_id))
        self.requests.end(request_id, abort=False)
        return moved

    async def precopy(self, task: PreCopy) -> int:
        """Before ``task.request_id`` moves here from ``task.holder``, where it still decodes:
        copy the KV of its full blocks so far (``decode_worker.precopy``). Returns how many
        leading blocks of it this worker holds now, for the move (``move_out``'s
        ``from_block``); 0, holding nothing, where it copied none (it cannot take KV this
        way, the request runs here, no room, the copy failed)."""
        if self.precopier is None or task.request_id in self.requests:
            return 0
        return await self.precopier.copy(task)

    async def lend_running(self, loan: RunningLoan) -> KVHandoff | None:
        """Export a running request's full blocks as ``loan`` asks (for the worker it moves
        to: ``precopy``) under a lease: the taker's confirmation, ``abort(loan.loan_id)``
        or the lease's end frees them. None when it has none past ``loan.from_block`` or
        cannot export (a TP or EP group)."""
        if self.mover is None:
            return None
        return await self._submit(LendRunning(loan, MOVES))

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        """Export the cached blocks of ``loan`` from ``loan.from_block`` on (a
        conversation's earlier turns, for the prefill worker computing its next) under a
        lease: the borrower's confirmation, ``abort(loan.request_id)`` or the lease's end
        frees them. None when it holds none of them or cannot export (a TP or EP group)."""
        if self.mover is None:
            return None
        return await self._submit(LendPrefix(loan, MOVES))

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        """A worker that took over requests from here holds verified copies of these
        transfers (for backends that confirm through the control plane): their leases end."""
        if self.mover is not None:
            self.mover.confirm(confirmations)

    async def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` and free its blocks (awaited); its batches not taken yet
        are dropped (the consumer stopped reading it); KV copied ahead of its move is freed.
        Idempotent."""
        if self.precopier is not None:
            self.precopier.taken(request_id)
        req = self.requests.get(request_id)
        if req is not None:
            req.outbox.drop(request_id)
            importing = req.importing
            if importing is not None and not importing.done():
                self.requests.end(request_id)  # its handover frees what its phase held (after a pull)
                await asyncio.wait([importing])
                return True
            self.requests.end(request_id, abort=False)
        return await asyncio.wrap_future(self._abort_in_engine(request_id))

    async def change_adapters(self, change: LoadAdapter | UnloadAdapter) -> str | None:
        """Load a LoRA adapter (its digest) or unload one: ``Engine.load_adapter``, ``unload_adapter``."""
        return await self._submit(change)

    async def arm_fault(self, armed: ArmedFault) -> None:
        """Inject a harness's fault into the handoff of a request yet to come (``wire.faults``:
        a pull after its lease, or a placement fault in its KV before its check)."""
        self._require_sink()
        self._side.faults.arm(armed)

    async def engine_thread(self) -> ThreadTimes:
        """Where its engine loop's thread spent its time (``EngineLoop.thread_times``)."""
        return self.loop.thread_times()

    async def stats(self, prefix_since: PrefixCursor | None = None) -> DecodeStats:
        """Load figures, and the prefix cache's changes since ``prefix_since``."""
        engine, prefix, _ = await self._submit(Snapshot(prefix_since))
        phases = self.requests.phases()
        return DecodeStats(
            self.worker_id,
            with_text_failures(engine, self.requests.text_failures),
            num_waiting_for_blocks=phases.count(Phase.WAITING_FOR_BLOCKS),
            num_pulling=phases.count(Phase.PULLING),
            prefix=prefix,
            peers=self.puller.peers if self.puller is not None else {},
        )

    def shutdown(self) -> None:
        self.loop.stop()
        if self.engine is not None and self.loop.error is None:
            self.engine.stop_followers()
        if self.puller is not None:
            self.puller.close()
        if self.mover is not None:
            self.mover.close()
            self.precopier.close()
        self.tp.destroy()

    # ---- internals ------------------------------------------------------------
    async def _submit(self, command: EngineCommand):
        """Run an engine command (``wire.engine_commands``) on the engine's thread."""
        return await asyncio.wrap_future(self.loop.submit(command))

    def _require_sink(self) -> None:
        if self.puller is None:
            raise InvalidRequest(f"worker {self.worker_id} is colocated and takes no KV from elsewhere")

    def _abort_in_engine(self, request_id: str):
        """Abort on the engine thread (a request moved away: its export released, and its
        blocks: ``RequestMover.release``); once its blocks are free, the admission queue's
        head is offered them. Returns the engine command's future."""
        future = self.loop.submit(Abort(request_id, MOVES if self.mover is not None else None))
        future.add_done_callback(lambda _: self._admission.wake_threadsafe())
        return future

    def tick(self) -> None:  # engine thread
        self._heartbeats.tick()  # idle ranks must hear from rank 0 within the group's timeout
        if self.mover is not None:
            self.mover.tick(self.engine)  # the blocks of requests moved away, once taken

    def on_error(self, error: BaseException) -> None:  # engine thread
        """The engine loop died (a bug, or a lost TP rank): every request ends with
        ``WorkerLost`` (the router resumes it on another decode worker)."""
        if self._aloop is not None:
            lost = WorkerLost(f"decode worker {self.worker_id} stopped: {error}")
            self._aloop.call_soon_threadsafe(self.requests.fail_all, lost)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:  # engine thread
        """One hand-over to the actor's loop per step, whatever the batch size, taken
        there (its loop is paced: ``EngineLoop.taken``) once their text is made and they
        are in their outboxes."""
        if self._aloop is None:  # no request came yet: nobody to tell
            self.loop.taken()
            return
        self._aloop.call_soon_threadsafe(self._deliver, outputs, time.time())

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:  # the actor's loop
        try:
            if self.requests.deliver(outputs, now):
                self._admission.wake()  # blocks were freed
        finally:
            self.loop.taken()
