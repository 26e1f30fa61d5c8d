"""One request's path through the cluster, and the router's admission control.

::

    generate(inp)
      validate (InvalidRequest) -> admit (Overloaded past LimitsSpec)
      -> pick a decode worker and a prefill worker (router.balancer), and decide
         where the prompt is prefilled (router.decider): LOCAL skips to generate
      -> prefill(task)                   -> first token: TokenEvent; a KVHandoff
      -> link the pair (handshakes, once per decode worker and prefill incarnation)
      -> generate(task with the handoff) -> first batch: confirmations, forwarded
                                            to the prefill worker (frees its KV)
                                         -> TokenEvents ... FinalEvent

From a prefill worker that streams KV (``router.prefill_call``) the handoff
comes first, as its last prefill step begins: the decode side starts on it at
once (its pull follows the layers as they are computed), then the first token
is passed on and handed to the decode worker (``first_token``). A prefill that
fails after that is told to the decode worker (``prefill_lost``), which ends
the request with ``PeerLost``: a failed transfer, as below.

A failed KV transfer (refused, corrupt, timed out, lease over, source gone)
is recomputed: the decode worker prefills the prompt and the first token
itself, within the request's deadline (``on_transfer_failure="fail"`` ends
the request instead); ``transfer_failures`` counts both.

A lost worker is retried once: a lost prefill worker before any token means
prefilling elsewhere; a lost decode worker means the request continues on
another decode worker, which prefills the prompt plus the tokens already sent
and generates the rest (greedy and seeded output is unchanged; nothing is sent
twice).

Whatever ends the request early (client cancel, deadline, error), the
``finally`` aborts it on every worker that saw it, so blocks are freed
everywhere. Deadlines bound every wait here, and are passed to the workers,
which enforce them too (a router that dies cannot leave work behind).

Each request's moments are marked as they happen, and its trace
(``router.trace``) goes to every sink in ``sinks`` when it ends, however it ends
(the trace log behind ``status --traces``, the metrics, the SLO planner).

Workers come from the ``WorkerRegistry``; the load the router puts on each
(prompt tokens queued, requests active, KV reserved) is recorded there for
exactly as long as the call that causes it lasts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from splitserve.decode_worker.api import DecodeTask, TokenBatch
from splitserve.engine.errors import InvalidRequest, Overloaded
from splitserve.engine.validation import RequestValidator
from splitserve.kv_transfer.errors import HandshakeRequired, KVTransferError, PeerLost
from splitserve.prefill_worker.api import PrefillTask
from splitserve.router.background import Background, cancel
from splitserve.router.balancer import Prompt, pick_decode, pick_prefill
from splitserve.router.decider import Decider, Placement
from splitserve.router.errors import WorkerLost, code_for
from splitserve.router.events import FinalEvent, GenerateInput, TokenEvent
from splitserve.router.peers import PeerLinks
from splitserve.router.policy import LimitsSpec, PolicySpec
from splitserve.router.prefill_call import PrefillCall
from splitserve.router.registry import WorkerRecord, WorkerRegistry
from splitserve.router.request import RequestState
from splitserve.router.trace import RequestTrace, TraceLog, TraceSink

log = logging.getLogger(__name__)

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
    ):
        self.registry = registry
        self.validator = validator
        self.served_model = served_model
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
        self.links = PeerLinks(registry)
        self.decider = Decider()
        self.inflight: dict[str, float] = {}  # request id -> accepted (time.time())
        self.admitted = 0  # requests admitted since start (the planner's arrivals)
        self.traces = TraceLog(traces_kept)
        self.sinks: list[TraceSink] = [self.traces]  # each request's trace, when it ends
        self._background = Background()  # worker calls not awaited

    @property
    def decode_role(self) -> str:
        return "colocated" if self.colocated else "decode"

    def validate(self, inp: GenerateInput) -> list[int]:
        if inp.model and inp.model != self.served_model:
            raise InvalidRequest(f"unknown model {inp.model!r}; this server serves {self.served_model!r}")
        if inp.timeout_s is not None and inp.timeout_s <= 0:
            raise InvalidRequest("the timeout must be positive")
        return self.validator.validate(inp.prompt, inp.params, inp.messages)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Run one request; yields its tokens, then one ``FinalEvent``. Raises
        ``InvalidRequest``, ``Overloaded``, ``DeadlineExceeded``, ``WorkerLost``,
        ``KVTransferError``. Whatever the outcome, its trace goes to ``sinks``. The
        model's ``generation_config.json`` defaults fill the sampling fields in
        ``inp.unset`` first (here, once, for both front doors)."""
        timeouts = [t for t in (inp.timeout_s, self.limits.max_timeout_s) if t is not None]
        rid = inp.request_id or uuid.uuid4().hex
        inp = dataclasses.replace(inp, params=self.validator.defaults.apply(inp.params, inp.unset))
        req = RequestState(rid, [], inp.params, min(timeouts) if timeouts else None)
        outcome, ok, admitted = "CANCELLED", False, False
        try:
            prompt_ids = self.validate(inp)
            if rid in self.inflight:
                raise InvalidRequest(f"request id {rid!r} is already in use")
            if len(self.inflight) >= self.limits.max_inflight_requests:
                raise Overloaded(
                    f"the server is at capacity ({len(self.inflight)} requests in flight); retry later"
                )
            self.inflight[rid], admitted = req.accepted, True
            self.admitted += 1
            req.prompt_ids = prompt_ids  # a trace with no prompt is a request refused at the door
            async for event in self._run(req):
                if isinstance(event, FinalEvent):
                    outcome, ok = event.finish_reason.value, True
                if isinstance(event, TokenEvent) and req.first_token_at is None:
                    req.mark("first_token")  # passed on now (marked after the yield, it could
                    # come after the client had the token, as the front end resumes us late)
                yield event
        except Exception as e:
            outcome = code_for(e).name
            raise
        finally:
            if admitted:
                self.inflight.pop(rid, None)
                for worker in req.touched:
                    self._background.run(worker.client.abort(rid))
            self._record(req.trace(outcome, ok))

    def _record(self, trace: RequestTrace) -> None:
        for sink in self.sinks:
            try:
                sink.record(trace)
            except Exception:  # a broken metrics or tracing sink must not fail requests
                log.exception("recording the trace of %s failed", trace.request_id)

    # ---- the path ------------------------------------------------------------------
    async def _run(self, req: RequestState) -> AsyncIterator[TokenEvent | FinalEvent]:
        n = len(req.prompt_ids)
        decoders = self.registry.routable(self.decode_role)
        if not decoders:
            raise WorkerLost("no decode worker is available")
        decoders = [w for w in decoders if self._has_room(w)]
        if not decoders:
            raise Overloaded(
                "every decode worker has as many requests as its batch limit allows "
                f"({self.limits.batch_limits()}); retry later"
            )
        prompt = Prompt.of(req.prompt_ids, decoders[0].block_size)
        dw = pick_decode(decoders, prompt, n + 1)
        with self.registry.assigned(dw, req.request_id):
            async for event in self._serve(req, prompt, dw):
                yield event

    def _batch_cap(self, w: WorkerRecord) -> int | None:
        return self.limits.batch_cap(w.steps)

    def batch_caps(self) -> dict[str, int]:
        """Each decode worker's batch cap now, for metrics (workers with none are absent)."""
        caps = {w.worker_id: self._batch_cap(w) for w in self.registry.workers(self.decode_role)}
        return {wid: cap for wid, cap in caps.items() if cap is not None}

    def _has_room(self, w: WorkerRecord) -> bool:
        cap = self._batch_cap(w)
        return cap is None or len(w.assigned) < cap

    async def _serve(
        self, req: RequestState, prompt: Prompt, dw: WorkerRecord
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """``req`` from its prefill (here or on a prefill worker) to its last token, on
        ``dw`` or, if that one is lost, another decode worker."""
        n = len(req.prompt_ids)
        pw = None
        if not self.colocated:
            pw = pick_prefill(self.registry.routable("prefill"), prompt, self.policy.prefix_affinity)
        decision = self.decider.decide(self.policy, prompt, dw, pw, self.colocated)
        call: PrefillCall | None = None
        if decision.placement == Placement.REMOTE:
            call = await self._prefill(req, prompt, pw)
            if call is None:  # every prefill worker it tried was lost, and none is left
                self.decider.fallback()
                log.warning("no prefill worker is left for %s; %s prefills it", req.request_id, dw.worker_id)
        async with contextlib.AsyncExitStack() as held:
            task = DecodeTask(req.request_id, req.prompt_ids, req.params, req.remaining())
            prefill: WorkerRecord | None = None
            if call is not None:
                held.push_async_callback(call.close)
                if call.streamed is not None:  # the decode side starts now; the first token comes later
                    req.mark("kv_exported", worker=call.worker.worker_id)
                    req.kv_streamed = True
                    prefill = call.worker
                    task = dataclasses.replace(task, handoff=call.streamed)
                else:
                    result = await call.result(req.within)
                    call.delivered = True
                    for event in req.prefilled(result):
                        yield event
                    if result.finish_reason is not None:
                        return
                    prefill = self.registry.get(result.worker_id)
                    task = dataclasses.replace(
                        task, output_token_ids=result.output_token_ids, handoff=result.handoff
                    )
                if prefill is None:  # the prefill worker left the cluster meanwhile
                    task = self._resume_task(req)
            for attempt in range(2):
                try:
                    with self.registry.assigned(dw, req.request_id):
                        async for event in self._decode(req, dw, task, prefill, call):
                            yield event
                    return
                except WorkerLost:
                    self.links.forget(dw.worker_id)
                    candidates = [w for w in self.registry.routable(self.decode_role) if w is not dw]
                    dw = pick_decode(candidates, prompt, n + 1) if attempt == 0 else None
                    if dw is None:
                        raise
                    log.warning(
                        "decode worker lost during %s; continuing on %s", req.request_id, dw.worker_id
                    )
                    req.mark("resumed", worker=dw.worker_id)
                    task = self._resume_task(req)
                    if prefill is not None:  # the resumed task prefills again: free the export now
                        self._background.run(prefill.client.abort(req.request_id))

    async def _prefill(
        self, req: RequestState, prompt: Prompt, pw: WorkerRecord | None
    ) -> PrefillCall | None:
        """Prefill on ``pw`` (None: the balancer picks); a worker lost before its first
        event is replaced by the next pick, each worker tried once. None: no prefill
        worker is left to try."""
        tried: set[str] = set()
        n = len(req.prompt_ids)
        while True:
            if pw is None:
                candidates = [w for w in self.registry.routable("prefill") if w.worker_id not in tried]
                pw = pick_prefill(candidates, prompt, self.policy.prefix_affinity)
            if pw is None:
                return None
            tried.add(pw.worker_id)
            queued = pw.queued_prompt_tokens
            # An idle worker takes any prompt the validator allowed, however long.
            if queued and queued + n > self.limits.max_queued_prompt_tokens:
                raise Overloaded(f"prefill queues are full ({queued} prompt tokens waiting); retry later")
            req.touched.append(pw)
            task = PrefillTask(req.request_id, req.prompt_ids, req.params, req.remaining())
            try:
                return await PrefillCall.open(self.registry, pw, task, req.within)
            except WorkerLost:
                log.warning("prefill worker %s lost request %s; retrying", pw.worker_id, req.request_id)
                pw = None

    async def _decode(
        self,
        req: RequestState,
        dw: WorkerRecord,
        task: DecodeTask,
        prefill: WorkerRecord | None,
        call: PrefillCall | None,
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Stream ``task`` from ``dw``. A handoff's pair is linked first; a decode worker
        that lost its handshakes (restarted) is linked again once, before any token. If
        the handoff's source is gone before the pull, ``dw`` prefills the request itself."""
        req.touched.append(dw)
        req.decode_worker = dw.worker_id
        relinked = False
        while True:
            if task.handoff is not None:
                try:
                    await req.within(self.links.ensure(dw, prefill, task.handoff))
                except PeerLost as e:  # the KV's source is gone: prefill prompt + first token here
                    task = self._recompute(req, dw, prefill, e)
            try:
                async for event in self._stream(req, dw, task, prefill, call):
                    yield event
                return
            except HandshakeRequired:
                self.links.forget(dw.worker_id)
                if relinked:
                    raise
                relinked = True
            except KVTransferError as e:  # the pull failed (nothing was streamed from dw)
                if task.handoff is None:
                    raise
                task = self._recompute(req, dw, prefill, e)

    def _recompute(
        self, req: RequestState, dw: WorkerRecord, prefill: WorkerRecord | None, error: KVTransferError
    ) -> DecodeTask:
        """The KV handover failed: under ``on_transfer_failure == "recompute"``, the task
        that has ``dw`` prefill the request itself (its deadline still applies), and the
        export is freed; under ``"fail"``, ``error`` is raised."""
        action = self.on_transfer_failure
        self.transfer_failures[(type(error).__name__, action)] += 1
        if action == "fail":
            raise error
        log.warning("KV transfer of %s failed (%s); prefilling on %s", req.request_id, error, dw.worker_id)
        req.mark("kv_recompute", worker=dw.worker_id)
        if prefill is not None:
            self._background.run(prefill.client.abort(req.request_id))
        return self._resume_task(req)

    async def _stream(
        self,
        req: RequestState,
        dw: WorkerRecord,
        task: DecodeTask,
        prefill: WorkerRecord | None,
        call: PrefillCall | None,
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """``task``'s batches from ``dw``, as events. A streamed handoff's request starts
        on ``dw`` first (its pull follows the prefill), then ``call``'s first token is
        passed on and handed to ``dw``."""
        reserve = len(task.prompt_token_ids) + task.params.max_tokens
        local_prefill = task.handoff is None  # dw prefills the prompt: queued there until its first token
        to_prefill = len(task.prompt_token_ids) + (len(task.output_token_ids) if local_prefill else 0)
        started = False  # dw has said when it took the request into its batch
        async with contextlib.AsyncExitStack() as held:
            held.enter_context(self.registry.decoding(dw, req.request_id, reserve))
            if local_prefill:
                held.enter_context(self.registry.prefilling(dw, req.request_id, to_prefill))
            stream = await held.enter_async_context(contextlib.aclosing(dw.client.generate(task)))
            pending = None  # the stream's first batch, read ahead
            if task.first_token_later and call is not None:
                pending = asyncio.ensure_future(anext(stream))  # starts the request on dw
                held.push_async_callback(cancel, pending)  # before the stream closes
                try:
                    result = await call.result(req.within)
                except (WorkerLost, KVTransferError) as e:  # its KV will not be whole: dw ends the
                    # request with PeerLost, which the stream brings, and _decode recomputes
                    log.warning("prefill of %s failed after its KV began to stream: %s", req.request_id, e)
                    await req.within(dw.client.prefill_lost(req.request_id, str(e)))
                    result = None
                if result is not None and not call.delivered:
                    call.delivered = True
                    for event in req.prefilled(result):
                        yield event
                if result is not None and result.finish_reason is not None:
                    return
                if result is not None:
                    self._background.run(dw.client.first_token(req.request_id, result.output_token_ids))
            while True:
                try:
                    batch: TokenBatch = await req.within(pending if pending is not None else anext(stream))
                except StopAsyncIteration:
                    raise WorkerLost(f"decode worker {dw.worker_id} ended the stream early") from None
                pending = None
                if batch.confirmations and prefill is not None:
                    self._background.run(prefill.client.confirm(batch.confirmations))
                if batch.transfer_s is not None:
                    req.transfer_s = batch.transfer_s
                    req.kv_bytes = task.handoff.num_bytes if task.handoff is not None else 0
                    if req.prefilled_at is not None:
                        self.decider.observe_handover(time.monotonic() - req.prefilled_at)
                if batch.started_at is not None and not started:
                    started = True
                    req.mark_started(dw.worker_id, batch.started_at)
                if batch.token_ids and not req.marked("first_decode_token"):
                    req.mark("first_decode_token", worker=dw.worker_id)
                if local_prefill and (batch.token_ids or batch.finish_reason is not None):
                    self.registry.prefill_done(dw, req.request_id)
                    local_prefill = False
                req.cached = max(req.cached, batch.num_cached_tokens)
                if batch.token_ids or batch.text:
                    yield req.tokens(batch.token_ids, batch.text, batch.logprobs, batch.token_times)
                if batch.finish_reason is not None:
                    yield req.final(batch.finish_reason, req.prefill_worker, dw.worker_id)
                    return

    def _resume_task(self, req: RequestState) -> DecodeTask:
        """Continue on another decode worker: it prefills the prompt and the tokens
        already sent, and goes on after them (seeded sampling included) as if
        nothing had happened."""
        return DecodeTask(req.request_id, req.prompt_ids, req.params, req.remaining(), list(req.sent))
