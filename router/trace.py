"""One trace per request: where its time went, phase by phase, and on which workers.

A request's ``RequestLifecycle`` marks its moments as they happen
and, when the request ends however it ends, hands one ``RequestTrace`` to every
``TraceSink`` it has (the router's ``TraceLog`` for ``splitserve status
--traces``, the Prometheus metrics, an OpenTelemetry exporter)::

    mark               when (time.time(), on the clock named)
    ----------------   ---------------------------------------------------------------
    admitted           the router accepted the request (router)
    placed             the router sent it to a decode worker (router; the worker named)
    prefill_sent       its prompt went to a prefill worker (router; named; again on a retry)
    prefill_started    the prefilling engine scheduled the prompt (prefill or decode worker)
    first_token        the router passed the first token on (router)
    kv_exported        the prefill worker's KV handoff reached the decode worker (decode worker)
    decode_admitted    the decode worker took the request into its batch, KV landed (worker)
    first_decode_token the decode worker's first own token reached the router (router)
    resumed            the request continued on another decode worker (a lost one)
    redirected         its start on a decode worker failed; it was started on another (router)
    kv_recompute       the KV transfer failed; the decode worker prefilled the request itself
    finished           the request ended: last token, or the error (router)

Its phases tile ``admitted .. finished`` with no gap and no overlap, so they add
up to the end-to-end time exactly::

    queue        admitted -> prefill_started
    prefill      prefill_started -> first_token
    kv_transfer  first_token -> decode_admitted      (absent when prefilled locally)
    decode       decode_admitted (or first_token) -> finished

A mark missing (the request failed early) or out of order (another machine's
clock) is clamped to the marks around it, so a phase is never negative. The
decode worker passes the first token on before its pull ends, so ``kv_transfer``
is what the client waited beyond the first token; it is 0 when the KV had landed
before the router passed that token on (``kv_pull_s`` keeps the pull's own time).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol

PHASES = ("queue", "prefill", "kv_transfer", "decode")


@dataclass(frozen=True)
class Mark:
    name: str
    at: float  # time.time()
    worker: str = ""  # the worker it happened on, if any
    detail: str = ""  # what happened, where a mark says more (a failed transfer: its sentence)


@dataclass(frozen=True)
class Span:
    """One phase of a request."""

    name: str  # one of PHASES
    start: float  # time.time()
    end: float
    worker: str  # where it ran ("" for the router's own queue)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class RequestTrace:
    """A finished request (``outcome`` is its finish reason, or the gRPC code it failed with)."""

    request_id: str
    outcome: str
    ok: bool  # finished with a finish reason (not an error, not cancelled)
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    prefill_worker: str  # the prefill worker that made the first token ("" when the decode worker did)
    decode_worker: str  # the last one (a resumed request names the worker that finished it)
    kv_bytes: int  # KV pulled from a prefill worker (0 when prefilled locally)
    kv_pull_s: float  # the pull's duration on the decode worker (bytes moving and verified)
    marks: tuple[Mark, ...]
    token_times: tuple[float, ...]  # when each output token was sampled (worker clocks)
    kv_streamed: bool = False  # its KV was pulled layer by layer while prefill computed it
    prefix_pulled_tokens: int = 0  # prompt tokens its prefill worker copied from another
    prefix_pulled_from: str = ""  # that other prefill worker
    prefill_revision: str = ""  # the weights that prefilled it, as its prefill worker said ("" locally)
    decode_revision: str = ""  # those of its (last) decode worker
    adapter: str = ""  # the LoRA adapter it ran under ("": the base model)

    def at(self, name: str) -> float | None:
        """The first mark of that name, if there is one."""
        return next((m.at for m in self.marks if m.name == name), None)

    @property
    def admitted(self) -> float:
        return self.marks[0].at

    @property
    def finished(self) -> float:
        return self.marks[-1].at

    @property
    def e2e_s(self) -> float:
        return self.finished - self.admitted

    @property
    def ttft_s(self) -> float | None:
        first = self.at("first_token")
        return None if first is None else first - self.admitted

    @property
    def spans(self) -> tuple[Span, ...]:
        """The phases (see the module docstring), in order; a phase that never began is absent."""
        start, end = self.admitted, self.finished

        def clamp(name: str, floor: float) -> float | None:
            t = self.at(name)
            return None if t is None else min(max(t, floor), end)

        phases = [("queue", start, "")]  # (name, start, worker); each ends where the next begins
        begun = clamp("prefill_started", start)
        if begun is not None:
            phases.append(("prefill", begun, self.prefill_worker or self.decode_worker))
            first = clamp("first_token", begun)
            if first is not None and self.decode_worker:
                if not self.prefill_worker:
                    phases.append(("decode", first, self.decode_worker))
                else:
                    phases.append(("kv_transfer", first, self.decode_worker))
                    admitted = clamp("decode_admitted", first)
                    if admitted is not None:
                        phases.append(("decode", admitted, self.decode_worker))
        ends = [p[1] for p in phases[1:]] + [end]
        return tuple(Span(name, s, e, worker) for (name, s, worker), e in zip(phases, ends))

    def phases_s(self) -> dict[str, float]:
        """Seconds per phase, for every name in ``PHASES`` (0.0 for a phase that never began)."""
        out = dict.fromkeys(PHASES, 0.0)
        for span in self.spans:
            out[span.name] += span.seconds
        return out


class TraceSink(Protocol):
    """Takes every finished request's trace (called on the router's loop; must not block)."""

    def record(self, trace: RequestTrace) -> None: ...


class TraceLog:
    """The last ``keep`` traces, newest last (what ``splitserve status --traces`` shows)."""

    def __init__(self, keep: int = 100):
        self._traces: collections.deque[RequestTrace] = collections.deque(maxlen=keep)

    def record(self, trace: RequestTrace) -> None:
        self._traces.append(trace)

    def latest(self, n: int) -> list[RequestTrace]:
        return list(self._traces)[-n:] if n > 0 else []
