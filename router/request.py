"""The router's state for one request in flight: its deadline, and the marks its
trace is made of (``router.trace``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from splitserve.engine.errors import DeadlineExceeded
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import FinishReason
from splitserve.prefill_worker.api import PrefillResult
from splitserve.router.events import FinalEvent, TokenEvent
from splitserve.router.registry import WorkerRecord
from splitserve.router.trace import Mark, RequestTrace


class RequestState:
    """Owned by the one ``Dispatcher.generate`` call serving the request."""

    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.accepted = time.time()
        self._accepted_mono = time.monotonic()
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.touched: list[WorkerRecord] = []  # workers to abort on when the request ends
        self.sent: list[int] = []  # token ids yielded to the client so far
        self.token_times: list[float] = []  # when each of them was sampled (worker clocks)
        self.marks: list[Mark] = [Mark("admitted", self.accepted)]
        self.prefilled_at: float | None = None  # time.monotonic() when a prefill worker's result came
        self.prefill_worker = ""  # the prefill worker whose KV the decode worker took
        self.decode_worker = ""
        self.kv_bytes = 0
        self.kv_streamed = False  # the KV handoff streamed (layer-wise, during prefill)
        self.transfer_s = 0.0  # the KV pull, on the decode worker
        self.cached = 0

    def now(self) -> float:
        """The wall-clock time now, as the monotonic clock counts from ``accepted``: the
        router's own marks keep their true intervals even when the wall clock is stepped."""
        return self.accepted + (time.monotonic() - self._accepted_mono)

    def mark(self, name: str, at: float | None = None, worker: str = "") -> None:
        """Record a moment of the request (names: ``router.trace``); ``at`` (a worker's
        clock) defaults to now."""
        self.marks.append(Mark(name, self.now() if at is None else at, worker))

    def marked(self, name: str) -> float | None:
        return next((m.at for m in self.marks if m.name == name), None)

    @property
    def first_token_at(self) -> float | None:
        return self.marked("first_token")

    def trace(self, outcome: str, ok: bool) -> RequestTrace:
        """The request's trace, as it ends now with ``outcome``."""
        return RequestTrace(
            request_id=self.request_id,
            outcome=outcome,
            ok=ok,
            prompt_tokens=len(self.prompt_ids),
            cached_prompt_tokens=self.cached,
            output_tokens=len(self.sent),
            prefill_worker=self.prefill_worker,
            decode_worker=self.decode_worker,
            kv_bytes=self.kv_bytes,
            kv_pull_s=self.transfer_s,
            marks=(*self.marks, *(() if self.marked("finished") else (Mark("finished", self.now()),))),
            token_times=tuple(self.token_times),
            kv_streamed=self.kv_streamed,
        )

    def prefilled(self, result: PrefillResult) -> Iterator[TokenEvent | FinalEvent]:
        """A prefill worker's result: its first token, passed on (and the end, if the
        request ended at it)."""
        self.prefilled_at = time.monotonic()
        self.cached = result.num_cached_tokens
        self.prefill_worker = result.worker_id
        if result.scheduled_at is not None:
            self.mark("prefill_started", result.scheduled_at, result.worker_id)
        if result.handoff is not None and not self.marked("kv_exported"):
            self.mark("kv_exported", worker=result.worker_id)
        first = result.output_token_ids
        yield self.tokens(first, result.text, result.logprobs, [result.token_time] * len(first))
        if result.finish_reason is not None:
            yield self.final(result.finish_reason, result.worker_id, "")

    def tokens(
        self, token_ids: list[int], text: str, logprobs: list[float], times: list[float]
    ) -> TokenEvent:
        """Tokens passed on to the client now (sampled at ``times``, worker clocks)."""
        self.sent.extend(token_ids)
        self.token_times.extend(times)
        ms = [max(0.0, (t - self.accepted) * 1000) for t in times]
        return TokenEvent(list(token_ids), text, list(logprobs), ms)

    def final(self, reason: FinishReason, prefill_id: str, decode_id: str) -> FinalEvent:
        """The request ends now with ``reason``: its last event, with its trace's phases."""
        self.mark("finished")
        trace = self.trace(reason.value, True)
        phases = trace.phases_s()
        return FinalEvent(
            finish_reason=reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.sent),
            cached_prompt_tokens=self.cached,
            queue_ms=phases["queue"] * 1000,
            prefill_ms=phases["prefill"] * 1000,
            transfer_ms=phases["kv_transfer"] * 1000,
            decode_ms=phases["decode"] * 1000,
            kv_pull_ms=self.transfer_s * 1000,
            ttft_ms=(trace.ttft_s or trace.e2e_s) * 1000,
            e2e_ms=trace.e2e_s * 1000,
            prefill_worker=prefill_id,
            decode_worker=decode_id,
        )

    def mark_started(self, worker_id: str, at: float) -> None:
        """A decode worker took the request into its batch at ``at``: its prefill began
        then (a local prefill), or, after a first token from a prefill worker, the
        decode phase did."""
        if not self.marked("prefill_started"):
            self.mark("prefill_started", at, worker_id)
        elif self.marked("first_token") and not self.marked("decode_admitted"):
            self.mark("decode_admitted", at, worker_id)

    def remaining(self) -> float | None:
        """Seconds left before the deadline (at least 1 ms), or None without one."""
        return None if self.deadline is None else max(0.001, self.deadline - time.monotonic())

    async def within(self, awaitable):
        """Await a worker call; past the deadline, ``DeadlineExceeded`` (the call is cancelled)."""
        if self.deadline is None:
            return await awaitable
        # A timeout scope in this task, not ``wait_for``: in 3.11 that wraps every awaitable
        # in a task of its own, and this runs once per token batch of every stream.
        try:
            async with asyncio.timeout(self.deadline - time.monotonic()):
                return await awaitable
        except TimeoutError:
            raise DeadlineExceeded(
                f"request {self.request_id} did not finish within {self.timeout_s:.3g} s"
            ) from None
