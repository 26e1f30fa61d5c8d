"""What an engine measures of its own steps, for its ``stats``: the prompt rate and
the decode step time, as decaying totals, and a MoE model's expert load.
Bookkeeping only: no torch."""

from __future__ import annotations

import time


class DecodeSteps:
    """The mean batch size and duration of recent decode-only steps (totals that decay
    by ``decay`` per step, as ``PrefillRate``): one point of the worker's step-time line,
    which the SLO planner fits across polls."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self._steps = self._seqs = self._seconds = 0.0

    def add(self, batch: int, seconds: float) -> None:
        d = self.decay
        self._steps, self._seqs, self._seconds = (
            self._steps * d + 1,
            self._seqs * d + batch,
            self._seconds * d + seconds,
        )

    @property
    def batch(self) -> float:
        return self._seqs / self._steps if self._steps else 0.0

    @property
    def step_s(self) -> float:
        return self._seconds / self._steps if self._steps else 0.0


class PrefillRate:
    """Prompt tokens per second over recent steps that computed prompt tokens: token
    and time totals that decay by ``decay`` per step (so one odd step moves it little,
    and it follows a load that changes)."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self._tokens = 0.0
        self._seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self._tokens = self._tokens * self.decay + tokens
        self._seconds = self._seconds * self.decay + seconds

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else 0.0


class ExpertLoad:
    """Rows routed to each expert of a MoE model, summed over its MoE layers: since the
    engine started (``total``) and over the last whole window of about ``window_s``
    seconds (``recent``; empty until one has passed, ``recent_s`` its length). Counts
    come in batches (``add``), each batch counted in the window it closes."""

    def __init__(self, num_experts: int, window_s: float = 10.0, clock=time.monotonic):
        self.window_s, self._clock = window_s, clock
        self.total = [0] * num_experts
        self.recent: tuple[int, ...] = ()
        self.recent_s = 0.0
        self._window = [0] * num_experts
        self._since = clock()

    def add(self, counts: list[int]) -> None:
        self.total = [a + b for a, b in zip(self.total, counts)]
        self._window = [a + b for a, b in zip(self._window, counts)]
        now = self._clock()
        if now - self._since >= self.window_s:
            self.recent, self.recent_s = tuple(self._window), now - self._since
            self._window, self._since = [0] * len(self._window), now
