"""The router's typed records between its front ends (gRPC, HTTP) and the
dispatcher: what a request asks for, and what its stream yields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.wire.chat import ChatTemplating
from splitserve.wire.outputs import PromptLogprob, TopLogprobs
from splitserve.wire.sampling import FinishReason, SamplingParams


@dataclass(frozen=True)
class GenerateInput:
    """A validated-shape request as the router's front ends (gRPC, HTTP) build it."""

    params: SamplingParams
    prompt: str | list[int] | None = None  # text or token ids
    messages: list[dict[str, Any]] | None = None
    templating: ChatTemplating | None = None  # how the messages are rendered (tools, template, variables)
    model: str = ""
    request_id: str = ""
    timeout_s: float | None = None
    unset: frozenset[str] = frozenset()  # defaulted fields the client left unset (wire.defaults.DEFAULTED)


@dataclass(frozen=True)
class TokenEvent:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    times_ms: list[float]  # per token, since the router accepted the request
    prompt_tokens: int  # the request's, for usage reported while it streams
    top_logprobs: list[TopLogprobs]  # per token, when the request asked for them
    prompt_logprobs: list[PromptLogprob] | None = None  # once, on the first event, when asked
    index: int = 0  # the sequence (of ``n``) these tokens are of


@dataclass(frozen=True)
class FinalEvent:
    """How a request ended. ``queue_ms + prefill_ms + transfer_ms + decode_ms == e2e_ms``:
    the phases of its trace (``router.trace``)."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    queue_ms: float
    prefill_ms: float
    transfer_ms: float  # first token -> decode worker holds the KV (0 when prefilled there)
    decode_ms: float
    kv_pull_ms: float  # the part of transfer_ms the decode worker spent pulling the bytes
    ttft_ms: float
    e2e_ms: float
    prefill_worker: str
    decode_worker: str
    index: int = 0  # the sequence (of ``n``) that ended
    # speculative decoding: tokens proposed for it and kept, summed over the decode
    # workers it ran on
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
