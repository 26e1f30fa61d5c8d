"""How many tokens to propose for one request: adapted to its own acceptance.

A request's per-token acceptance rate a is estimated from its verified steps (a
step that proposed k and kept m of them accepted m tokens and, when m < k, rejected
one: a truncated geometric, so a = accepted / (accepted + rejections), decayed so
that it follows the text). The j-th proposed token is kept with probability a^j;
it costs a row of the verification step and the proposer's time for it. A request
proposes the longest k whose last token still has a^k >= ``min_gain`` (those costs
as a fraction of a decode token's, measured: ``speculative.cost``), capped by the
config. At k = 0 it still proposes
one token every ``PROBE_EVERY`` steps, so a request whose text turns copyable is
seen; each probe rejected doubles that interval (to ``MAX_PROBE_EVERY``), a probe
kept resets it. Where a draft token costs a decode token or more (``min_gain`` >= 1:
no acceptance rate below 1 pays for it), it does not probe either.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 8
MAX_PROBE_EVERY = 64
DECAY = 0.9  # weight of what came before, per verified step
PRIOR = (2.0, 1.0)  # (accepted, rejections) a new request starts from: a = 2/3


@dataclass
class Acceptance:
    """One request's record of speculation (owned by its ``RequestState``)."""

    max_k: int
    proposed: int = 0  # tokens proposed for it, all steps
    accepted: int = 0  # of those, kept
    steps: int = 0  # verified steps
    _hits: float = PRIOR[0]
    _misses: float = PRIOR[1]
    _idle: int = 0  # steps since it last proposed while k was 0
    _probe_every: int = PROBE_EVERY
    _probing: bool = False  # the last k() was a probe

    @property
    def rate(self) -> float:
        """The decayed per-token acceptance estimate."""
        return self._hits / (self._hits + self._misses)

    def k(self, min_gain: float) -> int:
        """Tokens to propose this step (see the module docstring)."""
        a, k = self.rate, 0
        while k < self.max_k and a ** (k + 1) >= min_gain:
            k += 1
        if k:
            return k
        if min_gain >= 1:  # a draft token costs more than the token it may save: not even a probe
            return 0
        self._idle += 1
        if self._idle >= self._probe_every:
            self._idle, self._probing = 0, True
            return 1
        return 0

    def record(self, proposed: int, accepted: int) -> None:
        """A verified step proposed ``proposed`` tokens and kept ``accepted`` of them."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        if self._probing:
            self._probing = False
            self._probe_every = PROBE_EVERY if accepted else min(2 * self._probe_every, MAX_PROBE_EVERY)
        self._hits = DECAY * self._hits + accepted
        self._misses = DECAY * self._misses + (1 if accepted < proposed else 0)
