"""The one place a request is checked against a model and its cache.

``RequestValidator`` holds only plain data and a tokenizer, so it pickles: the
engine uses it at its front door, and a router gets a copy from a worker and
rejects bad input before it costs any worker anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from splitserve.wire.chat import ChatTemplating
from splitserve.wire.defaults import GenerationDefaults
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import DEFAULT_MAX_TOKENS, SamplingParams, StructuredOutput


class Tokenizer(Protocol):
    """What validation needs of a tokenizer (``engine.tokenizer.Tokenizer`` is one)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], templating: ChatTemplating | None = None
    ) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_plain(self, text: str) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def grammar(self, spec: StructuredOutput, output_token_ids: list[int] = ()) -> object: ...


@dataclass
class RequestValidator:
    model: str  # the name requests may use for this model
    vocab_size: int
    max_model_len: int  # prompt + output tokens at most
    max_kv_tokens: int  # tokens the smallest KV cache that must hold the request can hold
    tokenizer: Tokenizer | None
    # the model's defaults for the sampling fields a request leaves unset
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # the server's chat template in place of the model's (``router.chat_template``); a
    # request's own (``ChatTemplating.template``) wins over it
    chat_template: str | None = None

    def validate(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        messages: list[dict[str, str]] | None = None,
    ) -> list[int]:
        """Encode the prompt, then check it and ``params``. Raises ``InvalidRequest``
        with a sentence a user can act on. Returns the prompt's token ids."""
        _check_params(params)
        prompt_ids = self.encode(prompt, messages)
        self._check(prompt_ids, params)
        return prompt_ids

    def prepare(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        messages: list[dict[str, Any]] | None,
        unset: Collection[str],
        templating: ChatTemplating | None = None,
    ) -> tuple[list[int], SamplingParams]:
        """A front door's request as the workers run it: the prompt's token ids, and
        ``params`` with the fields named in ``unset`` defaulted the same way for every
        front door: sampling fields by ``defaults`` (the model's, else the server's);
        ``max_tokens`` to the rest of the context for chat ``messages``, else
        ``DEFAULT_MAX_TOKENS`` (as vLLM), never past the context. Raises
        ``InvalidRequest`` as ``validate`` does."""
        _check_params(params)
        prompt_ids = self.encode(prompt, messages, templating)
        params = self.defaults.apply(params, unset)
        params = self.with_bad_words_ids(params)
        if "max_tokens" in unset:
            room = self.max_model_len - len(prompt_ids)
            wanted = room if messages is not None else min(DEFAULT_MAX_TOKENS, room)
            params = dataclasses.replace(params, max_tokens=max(1, wanted))
        self._check(prompt_ids, params)
        return prompt_ids, params

    def with_bad_words_ids(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``bad_words`` turned into ``bad_words_ids``: each word as
        tokenized and after a space (as vLLM). Unchanged without bad words."""
        if not params.bad_words:
            return params
        tokenizer = self._require_tokenizer()
        ids = set(params.bad_words_ids)
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids.add(tuple(tokenizer.encode_plain(text)))
        return dataclasses.replace(params, bad_words=(), bad_words_ids=tuple(sorted(ids)))

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise InvalidRequest(
                f"the prompt has {n} tokens but the model's context is {limit} tokens, "
                "and at least one must remain for output"
            )
        if n + params.max_tokens > limit:
            raise InvalidRequest(
                f"the prompt has {n} tokens and max_tokens is {params.max_tokens}, "
                f"more than the model's context of {limit} tokens; "
                f"lower max_tokens to at most {limit - n}"
            )
        if n + 1 > self.max_kv_tokens:
            raise InvalidRequest(f"the prompt has {n} tokens, more than this engine's KV cache holds")
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer, and this engine has none")
        if params.min_tokens > params.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({params.min_tokens}) is more than max_tokens ({params.max_tokens})"
            )
        if params.structured is not None:
            self.grammar(params.structured)  # InvalidRequest if it cannot be used
        outside = sorted({t for t in params.token_ids_named() if t >= self.vocab_size})
        if outside:
            raise InvalidRequest(f"token ids {outside[:5]} are not in the vocabulary [0, {self.vocab_size})")

    def encode(
        self,
        prompt: str | list[int] | None,
        messages: list[dict[str, Any]] | None,
        templating: ChatTemplating | None = None,
    ) -> list[int]:
        """Token ids of a raw prompt, token ids, or chat ``messages`` (exactly one), the
        messages rendered as ``templating`` says (the server's template unless it names
        one). A message needs a role, and content unless it carries tool calls."""
        if (prompt is None) == (messages is None):
            raise InvalidRequest("give exactly one of a prompt or chat messages")
        if messages is not None:
            if not messages or any(
                not isinstance(m, dict) or "role" not in m or ("content" not in m and "tool_calls" not in m)
                for m in messages
            ):
                raise InvalidRequest("messages must be a non-empty list of {role, content}")
            templating = templating or ChatTemplating()
            if templating.template is None and self.chat_template is not None:
                templating = dataclasses.replace(templating, template=self.chat_template)
            return self._require_tokenizer().apply_chat_template(messages, templating)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            return self._require_tokenizer().encode(prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens skipped), as outputs are decoded."""
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidRequest(f"token ids must be integers in [0, {self.vocab_size})")
        return self._require_tokenizer().decode(token_ids)

    def grammar(self, spec: StructuredOutput) -> object:
        """A structured-output matcher for ``spec`` (``engine.structured.Grammar``), from
        the tokenizer; ``InvalidRequest`` for a spec it cannot use."""
        if self.tokenizer is None:
            raise InvalidRequest("structured output needs a tokenizer, and this model has none")
        return self.tokenizer.grammar(spec)

    def token_text(self, token_id: int) -> str:
        """One token's own text, as logprobs name it (``token_id:ID`` without a tokenizer)."""
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else f"token_id:{token_id}"

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer; send token ids")
        return self.tokenizer


def _check_params(params: SamplingParams) -> None:
    if not isinstance(params, SamplingParams):
        raise InvalidRequest("sampling parameters must be a SamplingParams")
    params.validate()
