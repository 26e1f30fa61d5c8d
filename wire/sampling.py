"""Per-request sampling parameters (validated once at the engine's front door) and
why an output ended."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from splitserve.wire.errors import InvalidRequest

DEFAULT_MAX_TOKENS = 16  # a request that does not say how many tokens gets these
MAX_TOP_LOGPROBS = 20  # as OpenAI (and vLLM's default max_logprobs)
MAX_N = 64  # sequences per request (``n``): each is a decode slot of its own
# Temperature's range (docs/api.md says why): wider than OpenAI's [0, 2], which would refuse
# what vLLM clients send; past 100 the distribution of any model's logits is as flat as
# float32 can tell, so a larger value means nothing more. Below MIN_TEMPERATURE (but > 0)
# the sampler divides by MIN_TEMPERATURE instead, as vLLM does: logits / 1e-300 overflow.
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 0.01
MAX_TOP_K = 2**31 - 1  # top_k past the vocabulary keeps every token (the sampler clamps it)
MAX_SEED = 2**64 - 1  # as protobuf's uint64


class FinishReason(str, enum.Enum):
    """Why a request's output ended."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context reached
    ABORT = "abort"  # cancelled by the caller
    PREFILL_DONE = "prefill_done"  # prefill-only request produced its first token


STRUCTURED_KINDS = ("json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """The form every output token must keep (``engine.structured``): a JSON schema
    (JSON text), a regex, a choice (a JSON list of strings) or a Lark grammar."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}")
        if not isinstance(self.spec, str) or not self.spec:
            raise InvalidRequest(f"the {self.kind} for structured output is empty")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` means greedy (argmax); ``top_k == 0`` and ``top_p == 1``
    disable those filters. With ``seed`` set, sampling is reproducible: the noise
    for the n-th generated token depends only on ``(seed, n)``, not on which other
    requests share the batch, nor on which worker (prefill or decode) samples it.
    ``logprobs`` asks for the log-probability of each chosen token under the
    model's unmodified distribution (before any processing below), and
    ``top_logprobs`` for that many most likely tokens' at each step as well.

    Before a token is picked (greedy rows too), per row and in this order:
    ``allowed_token_ids`` (every other token is masked), ``bad_words_ids`` (a
    sequence's last token masked when the output ends with the rest of it, as
    transformers' ``NoBadWordsLogitsProcessor``), ``min_tokens`` (EOS and
    ``stop_token_ids`` masked until that many tokens were generated, unless
    ``ignore_eos``), ``logit_bias`` (added), ``repetition_penalty`` (over prompt and
    output tokens: a positive logit divided by it, a negative one multiplied, as
    vLLM and transformers), ``frequency_penalty`` / ``presence_penalty`` (over
    output tokens: minus count x frequency, minus presence if present, as OpenAI);
    then sampled rows divide by the temperature (at least ``MIN_TEMPERATURE``);
    then NaN logits are masked and infinite ones made finite, and last of all
    ``structured`` masks the tokens its grammar does not allow next, so no
    transform can bring a forbidden token back. Then sampled rows: top-k, top-p
    (the most likely token always stays), ``min_p`` (tokens below ``min_p`` x the
    top token's probability dropped). A row left with no token to pick ends its
    request with ``Unsampleable``. Every input of these is in the
    sequence's tokens (the grammar's state too: it is rebuilt from them), so they
    hold across a handoff and a failover unchanged.

    ``n`` > 1 asks for that many sequences of the prompt. The router serves it
    (``router.dispatch``): sequence ``i`` samples as a request of its own with
    ``sequence(i)``'s parameters would (seed ``seed + i``, as vLLM); an engine
    runs one sequence per request.
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
    top_logprobs: int = 0  # with logprobs: also this many most likely tokens at each step
    # each prompt token's logprob given the tokens before it, and this many most likely
    # tokens' at each prompt position (None: none); such a prompt is never served from
    # the prefix cache (those positions would not be computed)
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is accepted
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = (
        False  # the stop string (or token) that ended the output stays in its text
    )
    skip_special_tokens: bool = True  # special tokens' text left out of the output text
    structured: StructuredOutput | None = None  # every token keeps the output in this form
    bad_words: tuple[str, ...] = ()  # never generated (vLLM's: as tokenized, and after a space)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # never generated, as token sequences
    n: int = 1  # sequences of the prompt (the router forks them; see the docstring)
    # False: a worker that speculates (engine.speculative) decodes this request without
    # (its tokens are the same either way; speculation only changes how fast they come)
    speculate: bool = True
    # the LoRA adapter (by the name the engine loaded it under) the request runs under;
    # None: the base model
    adapter: str | None = None

    def __post_init__(self) -> None:
        # Accept lists and dicts from callers but keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "bad_words_ids", tuple(tuple(w) for w in self.bad_words_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(k), float(v)) for k, v in bias))
        except (TypeError, ValueError, OverflowError):
            raise InvalidRequest("logit_bias maps token ids (>= 0) to values in [-100, 100]") from None
        object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        self.validate()

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature, top-k and top-p changes this row's logits."""
        return self.structured is not None or self.transforms_logits

    @property
    def transforms_logits(self) -> bool:
        """Whether penalties, a bias, ``min_tokens`` or ``allowed_token_ids`` change this
        row's logits (``processes_logits`` but for a grammar's mask)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.logit_bias
            or self.min_tokens
            or self.allowed_token_ids is not None
            or bool(self.bad_words_ids)
        )

    def sequence(self, i: int) -> SamplingParams:
        """The parameters of sequence ``i`` of an ``n`` > 1 request, as a request of its
        own: ``n`` 1, seed ``seed + i`` (unseeded stays unseeded), and the prompt's
        logprobs asked of the first sequence only (the prompt is the same)."""
        seed = None if self.seed is None else self.seed + i
        prompt_logprobs = self.prompt_logprobs if i == 0 else None
        return replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    def token_ids_named(self) -> list[int]:
        """Every token id these parameters name (checked against the vocabulary)."""
        return [
            *self.stop_token_ids,
            *(t for t, _ in self.logit_bias),
            *(self.allowed_token_ids or ()),
            *(t for w in self.bad_words_ids for t in w),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ``InvalidRequest`` with a readable sentence if a value is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in _FLOATS:  # NaN and infinities fail every range check below, but say so
            value = getattr(self, name)
            if not _is_number(value) or not _finite(value):
                raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
        if not (0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidRequest(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequest(
                f"top_k must be an integer in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k!r}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequest(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise InvalidRequest(f"adapter must be a LoRA adapter's name, got {self.adapter!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative integers")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequest(
                f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (0.0 < self.repetition_penalty <= 100.0):
            raise InvalidRequest(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value!r}")
        if any(t < 0 or not (-100.0 <= b <= 100.0) for t, b in self.logit_bias):
            raise InvalidRequest("logit_bias maps token ids (>= 0) to values in [-100, 100]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if any(not w or not isinstance(w, str) for w in self.bad_words):
            raise InvalidRequest("bad_words must be non-empty strings")
        if any(not w or any(not isinstance(t, int) or t < 0 for t in w) for w in self.bad_words_ids):
            raise InvalidRequest("bad_words_ids must be non-empty lists of token ids")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise InvalidRequest("allowed_token_ids must be a non-empty list of token ids")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")


# the float fields, each checked finite before its range
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: int | float) -> bool:
    return isinstance(value, int) or math.isfinite(value)  # math.isfinite(10**400) overflows


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
