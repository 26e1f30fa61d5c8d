"""The cluster simulator's records (``cluster.simulator``): what one worker costs
(``SimProfile``, measured by ``splitserve plan profile``), each request's fate
(``SimOutcome``), a run's result (``SimResult``) and a pool's bounds
(``PoolLimits``). Plain data: no event loop here."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from splitserve.cluster.sim_trace import SimRequest


@dataclass(frozen=True)
class SimProfile:
    """What one worker of each phase costs (``splitserve plan profile`` measures it)."""

    prefill_tokens_per_s: float  # one prefill worker, prompt tokens per second
    prefill_step_s: float  # fixed cost of a prefill step
    max_batched_tokens: int  # a prefill step's token budget (a longer prompt takes a step alone)
    decode_step_s: tuple[float, float]  # (a, b): a decode step of B sequences takes a + b * B
    max_batch: int  # a decode worker's max_num_seqs
    transfer_s: float = 0.002  # fixed cost of one KV handover
    transfer_s_per_token: float = 0.0  # and per prompt token
    start_s: float = 30.0  # a new worker's start until it is routable
    # Workers that share cores (one machine): a step's relative slowdown while the
    # other pool's workers are busy, times the busy share of them; 0 on separate hardware.
    prefill_slowdown: float = 0.0
    decode_slowdown: float = 0.0
    switch_s: float = 1.0  # elastic: a worker's role switch once it holds no work (not measured)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> SimProfile:
        """The inverse of ``to_json``; a missing or unknown field is a ValueError."""
        fields = json.loads(text)
        try:
            fields["decode_step_s"] = tuple(fields["decode_step_s"])
            return cls(**fields)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a simulator profile: {e}") from None


@dataclass
class SimOutcome:
    """One request's fate in a simulation (times in simulated seconds)."""

    spec: SimRequest
    first_token_s: float | None = None
    finished_s: float | None = None
    generated: int = 0
    local: bool = False  # prefilled by the decode worker that decodes it (no prefill worker routable)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.spec.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None until finished or for one token."""
        if self.finished_s is None or self.spec.output_tokens <= 1:
            return None
        return (self.finished_s - self.first_token_s) / (self.spec.output_tokens - 1)

    def met(self, ttft_ms: float, tpot_ms: float) -> bool:
        """Finished and met both targets (a one-token request has no TPOT to miss)."""
        return (
            self.finished_s is not None
            and self.ttft_s * 1000 <= ttft_ms
            and (self.tpot_s is None or self.tpot_s * 1000 <= tpot_ms)
        )


@dataclass
class SimResult:
    requests: list[SimOutcome]
    replica_seconds: dict[str, float]
    moves: dict[str, list[tuple[float, int]]]  # pool -> (time, +1 grow / -1 shrink)
    timeline: list[tuple[float, int, int]]  # (time, prefill routable, decode routable)
    end_s: float

    def ttft_s(self) -> list[float]:
        return [r.ttft_s for r in self.requests if r.ttft_s is not None]

    def tpot_s(self) -> list[float]:
        return [r.tpot_s for r in self.requests if r.tpot_s is not None]

    def attainment(self, ttft_ms: float, tpot_ms: float) -> float:
        """Fraction of all requests that finished and met both targets."""
        return sum(r.met(ttft_ms, tpot_ms) for r in self.requests) / max(len(self.requests), 1)

    def reversals_per_minute(self, pool: str) -> int:
        """The most direction reversals of ``pool`` within any 60 s."""
        flips = [t for (t, d), (_, prev) in zip(self.moves[pool][1:], self.moves[pool]) if d != prev]
        return max((sum(1 for u in flips if t <= u < t + 60) for t in flips), default=0)


@dataclass(frozen=True)
class PoolLimits:
    start: int
    min_replicas: int
    max_replicas: int
