"""One request's path through the cluster, and the router's admission control.

::

    generate(inp)
      validate (InvalidRequest) -> admit (Overloaded past the limits)
      -> pick a decode worker, and a prefill worker unless the policy prefills
         on the decode worker (colocated mode, or a prompt under the threshold)
      -> prefill.prefill(task)            -> first token: TokenEvent
      -> decode.generate(task) (stream)   -> TokenEvents ... FinalEvent

A lost worker is retried once: a lost prefill worker before any token means
prefilling elsewhere; a lost decode worker means the request continues on
another decode worker, which prefills the prompt plus the tokens already sent
and generates the rest (greedy output is unchanged; nothing is sent twice).

Whatever ends the request early (client cancel, deadline, error), the
``finally`` aborts it on every worker that saw it, so blocks are freed
everywhere. Deadlines bound every wait here, and are passed to the workers,
which enforce them too (a router that dies cannot leave work behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray

from splitserve.decode_worker.api import DecodeTask, TokenBatch
from splitserve.engine import (
    DeadlineExceeded,
    FinishReason,
    InvalidRequest,
    Overloaded,
    RequestValidator,
    SamplingParams,
)
from splitserve.prefill_worker.api import PrefillResult, PrefillTask
from splitserve.router.balancer import WorkerRef, pick_decode, pick_prefill
from splitserve.router.errors import WorkerLost, unwrap

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingPolicy:
    local_prefill_below_tokens: int = 0  # shorter prompts are prefilled on the decode worker
    prefix_affinity: bool = False
    max_inflight_requests: int = 1024  # admitted and not finished, over the whole router
    max_queued_prompt_tokens: int = 65536  # per prefill worker: sent, not yet prefilled
    max_timeout_s: float | None = None  # cap on any request's time


@dataclass(frozen=True)
class GenerateInput:
    """A validated-shape request as the router's front ends (gRPC, HTTP) build it."""

    params: SamplingParams
    prompt: str | list[int] | None = None  # text or token ids
    messages: list[dict[str, str]] | None = None
    model: str = ""
    request_id: str = ""
    timeout_s: float | None = None


@dataclass(frozen=True)
class TokenEvent:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    times_ms: list[float]  # per token, since the router accepted the request


@dataclass(frozen=True)
class FinalEvent:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    queue_ms: float
    ttft_ms: float
    transfer_ms: float
    e2e_ms: float
    prefill_worker: str
    decode_worker: str


class Dispatcher:
    """Routes requests over the current workers. Used from one asyncio loop."""

    def __init__(self, validator: RequestValidator, policy: RoutingPolicy, served_model: str):
        self.validator = validator
        self.policy = policy
        self.served_model = served_model
        self.prefill: list[WorkerRef] = []
        self.decode: list[WorkerRef] = []
        self.inflight: dict[str, float] = {}  # request id -> accepted (time.time())

    @property
    def colocated(self) -> bool:
        return not self.prefill

    def validate(self, inp: GenerateInput) -> list[int]:
        if inp.model and inp.model != self.served_model:
            raise InvalidRequest(f"unknown model {inp.model!r}; this server serves {self.served_model!r}")
        if inp.timeout_s is not None and inp.timeout_s <= 0:
            raise InvalidRequest("the timeout must be positive")
        return self.validator.validate(inp.prompt, inp.params, inp.messages)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Run one request; yields its tokens, then one ``FinalEvent``. Raises
        ``InvalidRequest``, ``Overloaded``, ``DeadlineExceeded``, ``WorkerLost``,
        ``KVTransferError``."""
        prompt_ids = self.validate(inp)
        rid = inp.request_id or uuid.uuid4().hex
        if rid in self.inflight:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        if len(self.inflight) >= self.policy.max_inflight_requests:
            raise Overloaded(
                f"the server is at capacity ({len(self.inflight)} requests in flight); retry later"
            )
        timeouts = [t for t in (inp.timeout_s, self.policy.max_timeout_s) if t is not None]
        req = _Request(rid, prompt_ids, inp.params, time.time(), min(timeouts) if timeouts else None)
        self.inflight[rid] = req.accepted
        try:
            async for event in self._run(req):
                yield event
        finally:
            self.inflight.pop(rid, None)
            for worker in req.touched:
                _fire_and_forget(worker.handle.abort.remote(rid))

    # ---- the path ------------------------------------------------------------------
    async def _run(self, req: _Request) -> AsyncIterator[TokenEvent | FinalEvent]:
        n = len(req.prompt_ids)
        dw = pick_decode(self.decode, n + 1)
        if dw is None:
            raise WorkerLost("no decode worker is available")
        local = self.colocated or n < self.policy.local_prefill_below_tokens
        result: PrefillResult | None = None
        if not local:
            result = await self._prefill(req)
            req.cached = result.num_cached_tokens
            first = result.output_token_ids
            yield self._tokens(req, first, result.text, result.logprobs, [result.token_time] * len(first))
            if result.finish_reason is not None:
                yield self._final(req, result.finish_reason, result.worker_id, "")
                return
        task = DecodeTask(req.request_id, req.prompt_ids, req.params, req.remaining())
        if result is not None:
            task = dataclasses.replace(
                task,
                output_token_ids=result.output_token_ids,
                descriptor=result.descriptor,
                handshake=result.handshake,
                shards=result.shards,
            )
        prefill_id = result.worker_id if result else ""
        for attempt in range(2):
            try:
                async for event in self._decode(req, dw, task, prefill_id):
                    yield event
                return
            except WorkerLost:
                dw = pick_decode([w for w in self.decode if w is not dw], n + 1) if attempt == 0 else None
                if dw is None:
                    raise
                log.warning("decode worker lost during %s; continuing on %s", req.request_id, dw.worker_id)
                task = self._resume_task(req)

    async def _prefill(self, req: _Request) -> PrefillResult:
        tried: set[int] = set()
        while True:
            pw = pick_prefill(
                [w for w in self.prefill if id(w) not in tried], req.prompt_ids, self.policy.prefix_affinity
            )
            if pw is None:
                raise WorkerLost("no prefill worker is available")
            tried.add(id(pw))
            n = len(req.prompt_ids)
            # An idle worker takes any prompt the validator allowed, however long.
            if pw.queued_prompt_tokens and pw.queued_prompt_tokens + n > self.policy.max_queued_prompt_tokens:
                raise Overloaded(
                    f"prefill queues are full ({pw.queued_prompt_tokens} prompt tokens waiting); retry later"
                )
            req.touched.append(pw)
            pw.queued_prompt_tokens += n
            pw.active += 1
            req.prefill_started = time.time()
            try:
                task = PrefillTask(req.request_id, req.prompt_ids, req.params, req.remaining())
                return await req.within(pw.handle.prefill.remote(task))
            except WorkerLost:
                log.warning("prefill worker %s lost request %s; retrying", pw.worker_id, req.request_id)
            finally:
                pw.queued_prompt_tokens -= n
                pw.active -= 1

    async def _decode(
        self, req: _Request, dw: WorkerRef, task: DecodeTask, prefill_id: str
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        req.touched.append(dw)
        reserve = len(task.prompt_token_ids) + task.params.max_tokens
        dw.active += 1
        dw.reserved_tokens += reserve
        stream = dw.handle.generate.remote(task)
        done = False
        try:
            while not done:
                try:
                    ref = await req.within(stream.__anext__())
                except StopAsyncIteration:
                    raise WorkerLost(f"decode worker {dw.worker_id} ended the stream early") from None
                batch: TokenBatch = await req.within(ref)
                if batch.transfer_s is not None:
                    req.transfer_s = batch.transfer_s
                req.cached = max(req.cached, batch.num_cached_tokens)
                if batch.token_ids or batch.text:
                    yield self._tokens(req, batch.token_ids, batch.text, batch.logprobs, batch.token_times)
                if batch.finish_reason is not None:
                    done = True
                    yield self._final(req, batch.finish_reason, prefill_id, dw.worker_id)
        finally:
            dw.active -= 1
            dw.reserved_tokens = max(0, dw.reserved_tokens - reserve)
            if not done:
                with contextlib.suppress(Exception):
                    ray.cancel(stream)

    def _resume_task(self, req: _Request) -> DecodeTask:
        """Continue on another decode worker: prefill prompt + sent tokens there."""
        left = req.params.max_tokens - len(req.sent)
        params = dataclasses.replace(req.params, max_tokens=max(1, left))
        return DecodeTask(req.request_id, req.prompt_ids + req.sent, params, req.remaining())

    def _tokens(self, req, token_ids, text, logprobs, times) -> TokenEvent:
        if req.first_token_at is None:
            req.first_token_at = time.time()
        req.sent.extend(token_ids)
        ms = [max(0.0, (t - req.accepted) * 1000) for t in times]
        return TokenEvent(list(token_ids), text, list(logprobs), ms)

    def _final(self, req: _Request, reason: FinishReason, prefill_id: str, decode_id: str) -> FinalEvent:
        now = time.time()
        started = req.prefill_started or req.accepted
        return FinalEvent(
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.sent),
            cached_prompt_tokens=req.cached,
            queue_ms=(started - req.accepted) * 1000,
            ttft_ms=((req.first_token_at or now) - req.accepted) * 1000,
            transfer_ms=req.transfer_s * 1000,
            e2e_ms=(now - req.accepted) * 1000,
            prefill_worker=prefill_id,
            decode_worker=decode_id,
        )


class _Request:
    """The router's state for one request in flight."""

    def __init__(self, request_id, prompt_ids, params, accepted: float, timeout_s: float | None):
        self.request_id = request_id
        self.prompt_ids: list[int] = prompt_ids
        self.params: SamplingParams = params
        self.accepted = accepted
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.touched: list[WorkerRef] = []  # workers to abort on if the request ends early
        self.sent: list[int] = []
        self.first_token_at: float | None = None
        self.prefill_started: float | None = None
        self.transfer_s = 0.0
        self.cached = 0

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.001, self.deadline - time.monotonic())

    async def within(self, awaitable):
        """Await a worker call before the deadline; errors come back unwrapped."""
        try:
            if self.deadline is None:
                return await awaitable
            return await asyncio.wait_for(awaitable, self.deadline - time.monotonic())
        except TimeoutError:
            raise DeadlineExceeded(
                f"request {self.request_id} did not finish within {self.timeout_s:.3g} s"
            ) from None
        except (ray.exceptions.RayError, ray.exceptions.ActorUnavailableError) as e:
            raise unwrap(e) from None


def _fire_and_forget(ref) -> None:
    """Let a Ray call run without awaiting it (its errors are of no interest)."""
    with contextlib.suppress(Exception):
        asyncio.ensure_future(_quiet(ref))


async def _quiet(ref) -> None:
    with contextlib.suppress(Exception):
        await ref


@dataclass(frozen=True)
class WorkerReport:
    """One worker's answer to a stats poll (or why it gave none)."""

    worker: WorkerRef
    stats: object | None  # PrefillStats | DecodeStats
    error: str = ""


async def poll_workers(workers: list[WorkerRef], timeout: float = 2.0) -> list[WorkerReport]:
    """Ask every worker for its stats at once; refresh each ``WorkerRef``'s view."""

    async def one(w: WorkerRef) -> WorkerReport:
        try:
            stats = await asyncio.wait_for(w.handle.stats.remote(), timeout)
        except Exception as e:
            err = unwrap(e)
            w.alive = not isinstance(err, WorkerLost)
            return WorkerReport(w, None, f"{err.__class__.__name__}: {err}")
        w.alive = True
        w.free_blocks = stats.engine.num_free_blocks
        w.num_blocks = stats.engine.num_blocks
        w.running = stats.engine.num_running
        w.reserved_tokens = 0  # the new free count includes what was reserved
        return WorkerReport(w, stats)

    return list(await asyncio.gather(*(one(w) for w in workers)))
