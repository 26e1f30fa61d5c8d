"""Per-request sampling parameters (validated once at the engine's front door) and
why an output ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from splitserve.wire.errors import InvalidRequest

DEFAULT_MAX_TOKENS = 16  # a request that does not say how many tokens gets these


class FinishReason(str, enum.Enum):
    """Why a request's output ended."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context reached
    ABORT = "abort"  # cancelled by the caller
    PREFILL_DONE = "prefill_done"  # prefill-only request produced its first token


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` means greedy (argmax); ``top_k == 0`` and ``top_p == 1``
    disable those filters. With ``seed`` set, sampling is reproducible: the noise
    for the n-th generated token depends only on ``(seed, n)``, not on which other
    requests share the batch, nor on which worker (prefill or decode) samples it.
    ``logprobs`` asks for the log-probability of each chosen token under the
    model's unmodified distribution (before temperature, top-k and top-p).
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ``InvalidRequest`` with a readable sentence if a value is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest(f"seed must be a non-negative integer, got {self.seed!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative integers")
