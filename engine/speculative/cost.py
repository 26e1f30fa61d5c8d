"""What a draft token costs, measured on the engine's own decode steps.

A draft token is worth proposing when the chance it is kept beats its price, both
counted in decode tokens (``adaptive``: the j-th token of a request with acceptance
rate a goes in while a^j >= ``min_gain``). Its price has two parts, each a fraction
of what one decode token costs now (a step's seconds over its sequences, T/S):

- its row of the verification step: the slope of step seconds over step rows, fitted
  (least squares, decayed) to the decode steps as they run; on a GPU at small batch a
  row is nearly free, on a CPU or a large batch it is not. Until the steps have
  varied enough to fit, ``PRIOR_ROW_COST``; after, the last fit while they do not
  (a probe now and then varies them less than the decay forgets);
- the proposer's time for one more draft position over a step's: ~0 for a lookup,
  about the draft's step over the target's for a model.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.95  # weight of what came before, per decode step
PRIOR_ROW_COST = 0.3
MIN_SPREAD = 1.0  # rows² of variance the fit needs before it is trusted


@dataclass
class StepCost:
    """Decayed sums over decode steps (one owner: the engine's ``Speculation``)."""

    _n: float = 0.0
    _rows: float = 0.0
    _secs: float = 0.0
    _seqs: float = 0.0
    _rows2: float = 0.0
    _rows_secs: float = 0.0
    _propose_s: float = 0.0  # decayed seconds of the proposer per draft position
    _slope: float | None = None  # seconds per row, the last fit the steps' spread allowed

    def stepped(self, seconds: float, rows: int, sequences: int) -> None:
        """A decode step of ``sequences`` sequences and ``rows`` query rows (one per
        sequence plus its draft tokens) took ``seconds``."""
        d = DECAY
        self._n = d * self._n + 1
        self._rows = d * self._rows + rows
        self._secs = d * self._secs + seconds
        self._seqs = d * self._seqs + sequences
        self._rows2 = d * self._rows2 + rows * rows
        self._rows_secs = d * self._rows_secs + rows * seconds
        mean_rows, mean_s = self._rows / self._n, self._secs / self._n
        spread = self._rows2 / self._n - mean_rows**2
        if spread >= MIN_SPREAD:
            self._slope = max((self._rows_secs / self._n - mean_rows * mean_s) / spread, 0.0)

    def proposed(self, seconds_per_position: float) -> None:
        self._propose_s = (
            DECAY * self._propose_s + (1 - DECAY) * seconds_per_position
            if self._propose_s
            else seconds_per_position
        )

    @property
    def token_s(self) -> float:
        """Seconds one decode token costs now (T/S); 0 before any step."""
        return self._secs / self._seqs if self._seqs else 0.0

    @property
    def row_cost(self) -> float:
        """A verification row's seconds over a decode token's (the fitted slope)."""
        if self._slope is None or not self.token_s:
            return PRIOR_ROW_COST
        return self._slope / self.token_s

    @property
    def proposer_cost(self) -> float:
        """The proposer's seconds per draft position over a step's."""
        step_s = self._secs / self._n if self._n else 0.0
        return self._propose_s / step_s if step_s else 0.0

    @property
    def min_gain(self) -> float:
        """The probability a draft token must have of being kept to be proposed."""
        return self.row_cost + self.proposer_cost
