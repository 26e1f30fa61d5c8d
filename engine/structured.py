"""Structured output: a request's grammar, as a mask on its row's logits.

Built on llguidance (chosen over xgrammar: it has no dependencies where xgrammar
pulls triton and a TVM runtime, it needs no ahead-of-time compilation (a
schema's grammar is parsed lazily, so a new schema costs about a millisecond),
and it takes every form vLLM's ``structured_outputs`` does: JSON schema, regex,
a choice of strings, and Lark grammars). ``docs/api.md`` maps the OpenAI and
vLLM fields onto ``StructuredOutput``.

A ``Grammar`` is one sequence's matcher. It is rebuilt from the output tokens a
request already has whenever an engine takes the request in (``Tokenizer.grammar``
with those tokens): so the first token sampled by a prefill worker, the handoff
to a decode worker, and a failover that resumes a request elsewhere all leave
it in the same state as a request that never moved.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import StructuredOutput

_BITS = torch.arange(32, dtype=torch.int32)  # bit i of a bitmask word: token 32 * word + i
# StructuredOutput.kind -> llguidance's grammar format
_FORMATS = {"json_schema": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


class GrammarCompiler:
    """Grammars for one tokenizer: each spec parsed once (an LRU of the last 256)."""

    def __init__(self, hf_tokenizer: Any):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.vocab_size = self.tokenizer.vocab_size

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one compiler per tokenizer, alive as long as it
    def _grammar(self, spec: StructuredOutput) -> str:
        import llguidance

        try:
            return llguidance.grammar_from(_FORMATS[spec.kind], spec.spec)
        except Exception as e:  # llguidance raises ValueError and friends on bad input
            raise InvalidRequest(f"the {spec.kind} for structured output is invalid: {e}") from None

    def grammar(self, spec: StructuredOutput, output_token_ids: list[int] = ()) -> Grammar:
        """A matcher for ``spec`` that has consumed ``output_token_ids``. Raises
        ``InvalidRequest`` with llguidance's words for a spec it cannot use, or for
        tokens the grammar does not allow."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, self._grammar(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the {spec.kind} for structured output is invalid: {matcher.get_error()}")
        grammar = Grammar(matcher, self.vocab_size)
        for t in output_token_ids:
            grammar.consume(t)
        return grammar


class Grammar:
    """One sequence's place in its grammar. Used by the engine's thread only."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's; logits may be wider (padded vocabularies)
        self._bitmask: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more."""
        return self.matcher.is_stopped()

    def consume(self, token_id: int) -> None:
        """Advance past a token the sequence produced; ``InvalidRequest`` if the grammar
        does not allow it (a token chosen under this grammar's mask always is). Tokens
        after the grammar is done (an EOS) change nothing."""
        if self.done:
            return
        if not self.matcher.consume_token(token_id):
            raise InvalidRequest(f"token {token_id} breaks the structured output: {self.matcher.get_error()}")

    def mask(self, row: torch.Tensor) -> None:
        """Set the logits of every token the grammar does not allow next to -inf (in place).
        (llguidance fills a bitmask, 32 tokens per int32; it is unpacked here rather than
        through ``llguidance.torch.apply_token_bitmask_inplace``, which compiles a kernel
        with ``torch.compile`` on the CPU.)"""
        import llguidance.torch

        if self._bitmask is None:
            self._bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        words = self._bitmask[0].to(row.device)
        allowed = ((words[:, None] >> _BITS.to(row.device)) & 1).bool().flatten()[: self.vocab_size]
        row[: self.vocab_size].masked_fill_(~allowed, float("-inf"))
        row[self.vocab_size :] = float("-inf")
