"""Serving metrics with the definitions of vLLM's ``vllm bench serve``, so numbers
from splitserve can be set beside vLLM's, SGLang's and DistServe's.

Per successful request (times in seconds, from when the client sent it):

- TTFT: first chunk's arrival.
- E2EL: last chunk's arrival (the request's latency).
- TPOT: ``(E2EL - TTFT) / (output_tokens - 1)``, for requests with more than
  one output token (a one-token request has no TPOT sample; for goodput its
  TPOT counts as 0, as in vLLM).
- ITL: every gap between consecutive chunks of a stream, pooled over all
  requests (a chunk may carry several tokens, as in vLLM).

Summaries are ``mean/median/std/pNN`` (``numpy.percentile``, linear) in ms,
under vLLM's keys (``mean_ttft_ms``, ``p99_itl_ms``, ...). splitserve adds the
server's handover (``median_handover_ms``, ...: first token -> the decode
worker holds the KV, from each request's ``Final``) where requests had one.

- goodput: successful requests meeting every given SLO, per second of the run
  (vLLM's ``request_goodput``);
- SLO attainment: the fraction of *all* requests that met every SLO, where a
  failed or rejected request is a miss (DistServe's definition).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What the load generator saw of one request."""

    prompt_len: int
    send_time: float  # when the request was sent (any clock; all times below on the same one)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each chunk
    success: bool = False
    rejected: bool = False  # refused by admission control (RESOURCE_EXHAUSTED)
    error: str = ""
    # the server's handover (first token -> the decode worker holds the KV), for a request
    # a prefill worker prefilled and a decode worker decoded; None otherwise
    handover: float | None = None

    @property
    def output_len(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.send_time

    @property
    def tpot(self) -> float | None:
        n = self.output_len
        return (self.latency - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def _summary(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0], dtype=float) * 1000
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def meets_slos(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a request met every SLO given (keys ``ttft``, ``tpot``, ``e2el``; ms)."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[k] * 1000 <= limit for k, limit in slos_ms.items())


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    slos_ms: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (50, 90, 99),
) -> dict[str, float | int]:
    """The run's metrics under vLLM's keys, plus ``failed``, ``rejected`` and
    ``slo_attainment``. ``duration_s`` is the whole run (first send to last arrival)."""
    unknown = set(slos_ms or {}) - {"ttft", "tpot", "e2el"}
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use ttft, tpot, e2el")
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    result: dict[str, float | int] = {
        "duration": duration_s,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": sum(not r.success and not r.rejected for r in records),
        "rejected": sum(r.rejected for r in records),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [g for r in ok for g in r.itls],
        "e2el": [r.latency for r in ok],
    }
    for name in METRICS:
        result |= _summary(name, samples[name], percentiles)
    handovers = [r.handover for r in ok if r.handover is not None]
    if handovers:
        result["handovers"] = len(handovers)
        result |= _summary("handover", handovers, percentiles)
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in records)
        result["request_goodput"] = good / duration_s
        result["slo_attainment"] = good / len(records) if records else 0.0
    return result
