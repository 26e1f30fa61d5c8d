"""One request's path through the cluster, and the router's admission control.

The router is a proxy: it sends each request to one decode worker and reads one
stream back. The decode worker does the rest (``decode_worker.worker``)::

    client --Generate--> router: validate, admit, pick a decode worker (router.balancer),
                         decide where the prompt is prefilled (router.decider), and
                         pick a prefill worker for it
           router --start(task, source=prefill worker)--> decode worker
                         decode worker --prefill_stream--> prefill worker
                         (links to it once per incarnation: its handshakes, by info)
                         the first token: prefill worker -> decode worker -> router
                         the KV: prefill worker ==transfer backend==> decode worker
                         (confirmed to the prefill worker by the backend, or by confirm)
           router <--token batches ... finish-- decode worker
    client <--tokens ... Final-- router

Each request is one ``RequestLifecycle`` (``router.lifecycle``), whose named
transitions are the failure handling here, every one within the request's
deadline:

- the prefill worker is lost before it hands any KV over (``PrefillLost`` from
  the decode worker): ``retry_prefill`` on another prefill worker, each tried
  once; with none left, the decode worker prefills it. Lost before it even took
  the request (``PrefillUnreachable``), it leaves routing at once and no loss is
  counted: the request never ran there;
- the KV transfer fails (refused, corrupt, timed out, lease over, source gone:
  ``KVTransferError``): ``recompute``, the decode worker prefills the prompt
  (and the first token, if it was passed on) itself (``on_transfer_failure=
  "fail"`` ends the request instead); ``transfer_failures`` counts both;
- the request's start on its decode worker fails (``WorkerUnreachable``: dead,
  restarting, or its connection closed with the start in flight): that worker
  leaves routing at once (``registry.unreachable``) and ``redirect`` starts the
  same work on another; no loss is counted, since the request never ran there;
- the decode worker is lost (``WorkerLost``): ``resume`` once on another decode
  worker, which prefills the prompt plus the tokens already sent and generates
  the rest (greedy and seeded output is unchanged; nothing is sent twice);
- a request present at ``MAX_WORKER_LOSSES`` worker losses (prefill or decode,
  in any order; a decode worker counts once the request started there) is ended
  with ``RequestCrashesWorkers`` (``INTERNAL``) and its fingerprint logged,
  instead of being tried again: a request that takes down every worker it
  reaches must not walk through the pool (Dynamo's migration limit, vLLM's
  retries are bounded the same way). One node's failure counts
  once: the loss of a decode worker that had just reported its prefill worker
  lost (``PrefillLost``), both on that node, is the same loss (``_Losses``).

A request with ``n`` > 1 is its first sequence, served as above, and ``n - 1``
forks that start on its decode worker once that worker holds the KV, prefilled
there from its prefix cache (``_fork``): one handover for all of them.

Nothing is aborted on success. A request that ends early (client cancel,
deadline, error) leaves its decode worker's stream, which aborts it there; the
decode worker releases whatever the prefill worker still holds for it. A lost
decode worker's prefill worker is told to let go of the request's export.

Each request's moments are marked as they happen, and its trace
(``router.trace``) goes to every sink in ``sinks`` when it ends, however it ends
(the trace log behind ``status --traces``, the metrics, the SLO planner).

Workers of one revision only work together (``WorkerRecord.revision``: the
weights each serves; the KV handshake refuses any other pair): the prefill
worker, a prefix's holder and a retry's prefill worker are of the decode
worker's revision, and a lost decode worker's request resumes on one of its
revision where one is left (else on another, which prefills it all again).
During a rolling upgrade each revision serves its requests whole.

Workers come from the ``WorkerRegistry``; the load the router puts on each
(prompt tokens queued, requests active, KV reserved) is recorded there for
exactly as long as the stream that causes it lasts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from splitserve.router.balancer import Prompt, pick_decode, pick_prefill
from splitserve.router.decider import Decider, Placement
from splitserve.router.errors import code_for
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.lifecycle import Phase, RequestLifecycle
from splitserve.router.moves import Moves
from splitserve.router.policy import LimitsSpec, PolicySpec
from splitserve.router.registry import Membership, WorkerRecord, WorkerRegistry, of_revision
from splitserve.router.roles import Role
from splitserve.router.trace import RequestTrace, TraceLog, TraceSink
from splitserve.wire.background import Background, cancelled_by_caller
from splitserve.wire.decode import DecodeTask
from splitserve.wire.errors import (
    AdapterMismatch,
    InvalidRequest,
    KVTransferError,
    Overloaded,
    PrefillLost,
    PrefillUnreachable,
    RequestCrashesWorkers,
    UnknownModel,
    WorkerLost,
    WorkerUnreachable,
)
from splitserve.wire.prefill import PrefixPull
from splitserve.wire.sampling import SamplingParams
from splitserve.wire.validation import RequestValidator

log = logging.getLogger(__name__)

# worker losses (prefill or decode) one request may be present at; at this many it is ended
MAX_WORKER_LOSSES = 2
# how long a request that goes on elsewhere waits for a worker to let go of it
ABORT_TIMEOUT_S = 5.0

__all__ = ["Dispatcher", "FinalEvent", "GenerateInput", "TokenEvent"]


class Dispatcher:
    """Routes requests over the registry's workers. Used from one asyncio loop.

    ``limits`` and ``policy`` may be replaced at any time (whole objects); each
    request reads them when it needs them."""

    def __init__(
        self,
        registry: WorkerRegistry,
        validator: RequestValidator,
        served_model: str,
        colocated: bool = False,
        limits: LimitsSpec | None = None,
        policy: PolicySpec | None = None,
        traces_kept: int = 100,
        on_transfer_failure: Literal["recompute", "fail"] = "recompute",
        adapters: tuple[str, ...] = (),
    ):
        """``adapters``: the LoRA adapters every worker loaded (``EngineConfig.lora_modules``),
        which a request names as its model."""
        self.registry = registry
        self.validator = validator
        self.served_model = served_model
        self.adapters = adapters
        self.colocated = colocated  # every worker does both phases; no prefill pool
        self.limits = limits or LimitsSpec()
        self.policy = policy or PolicySpec()
        if on_transfer_failure not in ("recompute", "fail"):
            raise ValueError(
                f"on_transfer_failure must be 'recompute' or 'fail', not {on_transfer_failure!r}"
            )
        self.on_transfer_failure = on_transfer_failure
        # (error class, "recompute" or "fail") -> KV transfers that failed so, since start
        self.transfer_failures: collections.Counter[tuple[str, str]] = collections.Counter()
        self.decider = Decider()
        self._inflight: set[str] = set()  # request ids admitted and not yet ended
        self.admitted = 0  # requests admitted since start (the planner's arrivals)
        self.admitted_prompt_tokens = 0  # their prompt tokens
        self.traces = TraceLog(traces_kept)
        self.sinks: list[TraceSink] = [self.traces]  # each request's trace, when it ends
        # live migration: moving the sequences on decode workers now (their lifecycles) elsewhere
        self.moves = Moves(registry, lambda: self.decode_role, self._has_room)
        self._background = Background()  # worker calls not awaited

    @property
    def decode_role(self) -> Role:
        return Role.COLOCATED if self.colocated else Role.DECODE

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def check_model(self, name: str) -> str | None:
        """The LoRA adapter a request naming model ``name`` runs under (None: the served
        model, or an empty name). ``UnknownModel`` (NOT_FOUND) for any other name."""
        if not name or name == self.served_model:
            return None
        if name in self.adapters:
            return name
        served = ", ".join(repr(n) for n in (self.served_model, *self.adapters))
        raise UnknownModel(f"unknown model {name!r}; this server serves {served}")

    def unroutable_roles(self) -> list[Role]:
        """The pools this router cannot serve without that have no routable worker now:
        colocated or decode. With no routable prefill worker the decode workers prefill
        (``Reason.NO_PREFILL_WORKER``; an elastic cluster's pooled roles), so it serves."""
        role = Role.COLOCATED if self.colocated else Role.DECODE
        return [] if self.registry.routable(role) else [role]

    def validate(self, inp: GenerateInput) -> tuple[list[int], SamplingParams]:
        """The request's prompt token ids and its sampling parameters with the fields it
        left unset defaulted (``RequestValidator.prepare``: once, for both front doors)."""
        adapter = self.check_model(inp.model)
        if inp.timeout_s is not None and inp.timeout_s <= 0:
            raise InvalidRequest("the timeout must be positive")
        prompt_ids, params = self.validator.prepare(
            inp.prompt, inp.params, inp.messages, inp.unset, inp.templating
        )
        if adapter is not None:  # what it names as its model is the adapter its workers run
            params = dataclasses.replace(params, adapter=adapter)
        return prompt_ids, params

    async def generate(self, inp: GenerateInput) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Run one request; yields its tokens, then one ``FinalEvent``. Raises
        ``InvalidRequest``, ``Overloaded``, ``DeadlineExceeded``, ``WorkerLost``,
        ``KVTransferError``. Whatever the outcome, its trace goes to ``sinks``."""
        timeouts = [t for t in (inp.timeout_s, self.limits.max_timeout_s) if t is not None]
        rid = inp.request_id or uuid.uuid4().hex
        life = RequestLifecycle(rid, [], inp.params, min(timeouts) if timeouts else None)
        outcome, ok, admitted = "CANCELLED", False, False
        try:
            prompt_ids, params = self.validate(inp)
            if rid in self._inflight:
                raise InvalidRequest(f"request id {rid!r} is already in use")
            if len(self._inflight) >= self.limits.max_inflight_requests:
                raise Overloaded(
                    f"the server is at capacity ({len(self._inflight)} requests in flight); retry later"
                )
            self._inflight.add(rid)
            admitted = True
            self.admitted += 1
            self.admitted_prompt_tokens += len(prompt_ids)
            # a trace with no prompt is a request refused at the door
            life = RequestLifecycle(rid, prompt_ids, params.sequence(0), life.timeout_s)
            events = self._serve(life) if params.n == 1 else self._fork(life, params)
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, FinalEvent) and event.index == 0:
                        outcome, ok = event.finish_reason.value, True
                    yield event
        except Exception as e:
            outcome = code_for(e).name
            raise
        finally:
            if admitted:
                self._inflight.discard(rid)
            self._record(life.trace(outcome, ok))

    def _record(self, trace: RequestTrace) -> None:
        for sink in self.sinks:
            try:
                sink.record(trace)
            except Exception:  # a broken metrics or tracing sink must not fail requests
                log.exception("recording the trace of %s failed", trace.request_id)

    def _batch_cap(self, w: WorkerRecord) -> int | None:
        return self.limits.batch_cap(w.steps)

    def batch_caps(self) -> dict[str, int]:
        """Each decode worker's batch cap now, for metrics (workers with none are absent)."""
        caps = {w.worker_id: self._batch_cap(w) for w in self.registry.workers(self.decode_role)}
        return {wid: cap for wid, cap in caps.items() if cap is not None}

    def _has_room(self, w: WorkerRecord) -> bool:
        cap = self._batch_cap(w)
        return cap is None or len(w.decoding) < cap

    # ---- the path ------------------------------------------------------------------
    async def _serve(self, life: RequestLifecycle) -> AsyncIterator[TokenEvent | FinalEvent]:
        """``life`` from placement to its last event, through its transitions (see the
        module docstring)."""
        n = len(life.prompt_ids)
        decoders = self.registry.routable(self.decode_role)
        if not decoders:
            raise WorkerLost("no decode worker is available")
        decoders = [w for w in decoders if self._has_room(w)]
        if not decoders:
            raise Overloaded(
                "every decode worker has as many requests as its batch limit allows "
                f"({self.limits.batch_limits()}); retry later"
            )
        prompt = Prompt.of(life.prompt_ids, decoders[0].block_size)
        dw = pick_decode(decoders, prompt, n + 1)
        pw = None
        if not self.colocated:
            prefillers = of_revision(self.registry.routable(Role.PREFILL), dw.revision)
            pw = pick_prefill(prefillers, prompt, self.policy.prefix_affinity)
        decision = self.decider.decide(self.policy, prompt, dw, pw, self.colocated)
        source = pull = None
        if decision.placement == Placement.REMOTE:
            source, pull = self._admit_prefill(pw, n), self._prefix_pull(prompt, pw)
        async for event in self._follow(life, life.place(dw, source, pull), prompt):
            yield event

    def _prefix_pull(self, prompt: Prompt, pw: WorkerRecord) -> PrefixPull | None:
        """Where ``pw`` may copy ``prompt``'s prefix from: another live prefill worker,
        or a decode worker that can export its cache (a conversation's earlier turns end
        there), draining ones too (their caches still serve), that holds more of it,
        where the decider judges the copy cheaper than computing it
        (``policy.prefix_pulls``; decode workers' with ``policy.decode_prefix_pulls``)."""
        if not self.policy.prefix_pulls:
            return None
        lenders = (Role.PREFILL, Role.DECODE) if self.policy.decode_prefix_pulls else (Role.PREFILL,)
        holders = [
            w
            for w in self.registry.workers(*lenders)
            if w is not pw
            and w.alive
            and w.state != Membership.STARTING
            and w.revision == pw.revision
            and (w.role == Role.PREFILL or (w.info is not None and bool(w.info.handshakes)))
        ]
        holder = self.decider.pull_source(prompt, pw, holders)
        if holder is None:
            return None
        lender = holder.client if holder.role == Role.PREFILL else holder.client.peer()
        return PrefixPull(lender, holder.worker_id, prompt.cached_on(holder) // pw.block_size)

    async def _fork(
        self, life: RequestLifecycle, params: SamplingParams
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """``params.n`` sequences of ``life``'s prompt, their events merged (each with its
        ``index``) until all have ended; the first failure ends them all.

        ``life`` is sequence 0 and is served as any request. Once its decode worker holds
        its KV (handed over once, or prefilled there), sequences 1..n-1 start on that
        worker, which prefills them itself: its prefix cache holds the prompt's full
        blocks, so only the last, partial one is computed again. Each samples as a request
        of its own with ``params.sequence(i)`` would, and fails over on its own. However it
        ends (all done, a failure, the caller closing it), every sequence's stream is closed
        here, which aborts what is still running on its worker (as for one request)."""
        queue: asyncio.Queue[tuple[int, TokenEvent | FinalEvent | Exception]] = asyncio.Queue()
        forks: list[RequestLifecycle] = []
        outcomes = ["CANCELLED"] * params.n  # each fork's, for its trace

        async def pump(i: int, events: AsyncIterator[TokenEvent | FinalEvent]) -> None:
            try:
                async with contextlib.aclosing(events):
                    async for event in events:
                        queue.put_nowait((i, event))
            except Exception as e:
                outcomes[i] = code_for(e).name
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(0, self._serve(life)))]
        try:
            ended = 0
            while ended < params.n:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if not forks and life.phase in (Phase.DECODING, Phase.FINISHED):
                    dw = life.decode_worker
                    prompt = Prompt.of(life.prompt_ids, dw.block_size)
                    for j in range(1, params.n):
                        fork = life.fork(f"{life.request_id}-{j}", params.sequence(j))
                        forks.append(fork)
                        events = self._follow(fork, fork.place(dw, None), prompt)
                        tasks.append(asyncio.create_task(pump(j, events)))
                if isinstance(item, FinalEvent):
                    ended += 1
                    outcomes[i] = item.finish_reason.value
                yield dataclasses.replace(item, index=i)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for j, fork in enumerate(forks, 1):
                self._record(fork.trace(outcomes[j], fork.phase is Phase.FINISHED))

    async def _follow(
        self, life: RequestLifecycle, task: DecodeTask, prompt: Prompt
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """``task`` (``life`` just placed) to ``life``'s last event, through its
        transitions (see the module docstring)."""
        n = len(life.prompt_ids)
        source = life.source
        tried = {source.worker_id} if source is not None else set()
        losses = _Losses()
        unreachable: set[str] = set()  # decode workers a start of it failed on
        self.moves.lives[life.request_id] = life
        try:
            async for event in self._failing_over(life, task, prompt, n, tried, losses, unreachable):
                yield event
        finally:
            self.moves.lives.pop(life.request_id, None)

    async def _failing_over(
        self,
        life: RequestLifecycle,
        task: DecodeTask,
        prompt: Prompt,
        n: int,
        tried: set[str],
        losses: _Losses,
        unreachable: set[str],
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        while True:
            try:
                async for event in self._stream(life, task):
                    yield event
                if not life.moving:
                    return
                try:
                    task = await life.migrate()  # its stream on the old worker ended: moved
                except Exception as e:
                    raise WorkerLost(f"request {life.request_id} could not move: {e}") from e
                continue
            except WorkerUnreachable as e:  # its start failed: it never ran there, no loss
                task = await self._redirect(life, e, prompt, n, unreachable)
                continue
            except PrefillUnreachable as e:  # it never took the request: no loss
                if life.source is not None:
                    self.registry.unreachable(life.source, f"{type(e).__name__}: {e}")
                lost = e
            except (PrefillLost, WorkerLost) as e:
                if losses.add(e, life) >= MAX_WORKER_LOSSES:
                    raise self._crashes_workers(life, losses.workers, e) from e
                lost = e
            except KVTransferError as e:
                if life.source is None and not life.moving:
                    raise
                # KV of another adapter's weights: recomputed here, the request would go on
                # under other weights than its first tokens' (an adapter loaded again)
                action = "fail" if isinstance(e, AdapterMismatch) else self.on_transfer_failure
                self.transfer_failures[(type(e).__name__, action)] += 1
                if action == "fail":
                    raise
                log.warning(
                    "request %s: %s; prefilling it on %s",
                    life.request_id,
                    life.transfer_failure(e),
                    life.decode_worker.worker_id,
                )
                task = life.recompute(e)
                continue
            if isinstance(lost, PrefillLost):  # nothing of it is held: another prefill worker, or dw
                candidates = [
                    w
                    for w in of_revision(self.registry.routable(Role.PREFILL), life.decode_worker.revision)
                    if w.worker_id not in tried
                ]
                source = pick_prefill(candidates, prompt, self.policy.prefix_affinity)
                if source is None:
                    self.decider.fallback()
                    log.warning(
                        "%s; no prefill worker is left, %s prefills it", lost, life.decode_worker.worker_id
                    )
                else:
                    log.warning("%s; retrying on %s", lost, source.worker_id)
                    self._admit_prefill(source, n)
                    tried.add(source.worker_id)
                task = life.retry_prefill(source)
            else:  # the decode worker
                gone, holders = life.decode_worker, (life.source, life.moved_from)
                candidates = [w for w in self.registry.routable(self.decode_role) if w is not gone]
                dw = pick_decode(of_revision(candidates, gone.revision) or candidates, prompt, n + 1)
                if dw is None:
                    raise lost
                log.warning("decode worker lost during %s; continuing on %s", life.request_id, dw.worker_id)
                for holder in holders:  # an export it may still hold for it is of no use now
                    if holder is not None and holder is not dw:
                        self._background.run(holder.client.abort(life.request_id))
                await self._clear(life, dw)
                task = life.resume(dw)

    async def _redirect(
        self, life: RequestLifecycle, error: WorkerUnreachable, prompt: Prompt, n: int, unreachable: set[str]
    ) -> DecodeTask:
        """``life``'s start on its decode worker failed (``error``): that worker leaves
        routing (``registry.unreachable``) and is not tried again for this request, which
        starts on another decode worker, preferring its revision; its prefill worker is
        kept where it is of the new one's revision. A start whose answer was lost may have
        reached the worker, which may have asked the prefill worker (or a move's holder)
        already: each is told to let go first. Raises ``error`` when no decode worker is
        left. Counted as no loss: the request never ran there."""
        gone = life.decode_worker
        self.registry.unreachable(gone, f"{type(error).__name__}: {error}")
        unreachable.add(gone.worker_id)
        candidates = [w for w in self.registry.routable(self.decode_role) if w.worker_id not in unreachable]
        dw = pick_decode(of_revision(candidates, gone.revision) or candidates, prompt, n + 1)
        if dw is None:
            raise error
        log.warning("%s: %s; starting %s on %s", gone.worker_id, error, life.request_id, dw.worker_id)
        # a start whose answer was lost may run there unseen: it would decode for nobody
        # and hold the request's id against a later return of the request there
        self._background.run(gone.client.abort(life.request_id))
        for holder in (life.source, life.moved_from):
            if holder is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(holder.client.abort(life.request_id), ABORT_TIMEOUT_S)
        await self._clear(life, dw)
        source = life.source if life.source is not None and life.source.revision == dw.revision else None
        return life.redirect(dw, source)

    @staticmethod
    async def _clear(life: RequestLifecycle, dw: WorkerRecord) -> None:
        """Before ``life`` goes to ``dw`` again after a failure: a decode worker it was on
        may still hold a leftover of it (a start whose answer was lost, the KV it exported
        for a move, an abort not done yet), which would refuse the new start as a request
        id in use; it lets go first (awaited, at most ``ABORT_TIMEOUT_S``)."""
        if life.was_on(dw):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(dw.client.abort(life.request_id), ABORT_TIMEOUT_S)

    @staticmethod
    def _crashes_workers(life: RequestLifecycle, lost: list[str], last: Exception) -> RequestCrashesWorkers:
        """The error that ends a request present at ``MAX_WORKER_LOSSES`` worker losses
        (``lost``: the workers, in order); its fingerprint (a hash of its prompt and
        parameters, which a client can recompute) is logged so that an operator can find
        it again."""
        digest = hashlib.sha256(repr((life.prompt_ids, life.params)).encode()).hexdigest()[:16]
        workers = ", ".join(lost)
        log.error(
            "request %s was present at %d worker losses (%s; the last: %s); ended, not retried. "
            "fingerprint %s: %d prompt tokens, %r",
            life.request_id,
            len(lost),
            workers,
            last,
            digest,
            len(life.prompt_ids),
            life.params,
        )
        return RequestCrashesWorkers(
            f"the request was on {len(lost)} workers that were lost while they ran it ({workers}), so it "
            f"is not tried on another (fingerprint {digest}); if it fails again, report it with that "
            "fingerprint"
        )

    def _admit_prefill(self, pw: WorkerRecord, prompt_tokens: int) -> WorkerRecord:
        """``pw`` takes the prompt unless its queue is full (``Overloaded``); an idle worker
        takes any prompt the validator allowed, however long."""
        queued = pw.queued_prompt_tokens
        if queued and queued + prompt_tokens > self.limits.max_queued_prompt_tokens:
            raise Overloaded(f"prefill queues are full ({queued} prompt tokens waiting); retry later")
        return pw

    async def _stream(
        self, life: RequestLifecycle, task: DecodeTask
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """``task`` on ``life``'s decode worker, its batches as events. The prompt counts
        as queued on whoever prefills it until the first token, the KV as reserved on the
        decode worker until the stream ends."""
        dw, rid = life.decode_worker, life.request_id
        prefiller = life.source or dw
        to_prefill = 0 if task.moved is not None else len(task.prompt_token_ids) + len(task.output_token_ids)
        reserve = len(task.prompt_token_ids) + task.params.max_tokens
        with self.registry.decoding(dw, rid, reserve), self.registry.prefilling(prefiller, rid, to_prefill):
            async with contextlib.aclosing(dw.client.generate(task)) as stream:
                with life.watch() as deadline:
                    while True:
                        try:
                            batch = await deadline.wait(anext(stream, None))
                        except asyncio.CancelledError:
                            if cancelled_by_caller():
                                raise
                            lost = f"the call to decode worker {dw.worker_id} was cut off"
                            raise WorkerLost(lost) from None
                        if batch is None:
                            raise WorkerLost(f"decode worker {dw.worker_id} ended the stream early")
                        handover = life.handover_s(batch)
                        if handover is not None:
                            self.decider.observe_handover(handover)
                        for event in life.on_batch(batch):
                            if isinstance(event, TokenEvent):
                                self.registry.prefill_done(prefiller, rid)
                            yield event
                            if isinstance(event, FinalEvent):
                                return
                        if batch.moved:  # its last batch there: it goes on where it moved
                            if not life.moving:
                                raise WorkerLost(f"decode worker {dw.worker_id} let {rid} go unasked")
                            return


class _Losses:
    """The worker losses one request was present at, one node's failure counted once."""

    def __init__(self):
        self.workers: list[str] = []  # each loss counted: the worker lost
        # after a PrefillLost: (the decode worker that reported it, the lost worker's node)
        self._prefill_lost_on: tuple[str, str] | None = None

    def add(self, error: PrefillLost | WorkerLost, life: RequestLifecycle) -> int:
        """Count ``error`` (``life``'s source or decode worker was lost); the count so far."""
        decode, source = life.decode_worker, life.source
        if isinstance(error, PrefillLost):
            node = source.node.node_id if source is not None and source.node else ""
            self._prefill_lost_on = (decode.worker_id, node) if node else None
            self.workers.append(source.worker_id if source is not None else "a prefill worker")
            return len(self.workers)
        node = decode.node.node_id if decode.node is not None else ""
        if not node or self._prefill_lost_on != (decode.worker_id, node):
            self.workers.append(decode.worker_id)  # not the node whose failure was just counted
        self._prefill_lost_on = None
        return len(self.workers)
