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
it in the same state as a request that never moved. No torch here (a router
validates specs with it); the masks a batch step applies are in ``structured_masks``.
"""

from __future__ import annotations

import functools
from typing import Any

from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import StructuredOutput

# StructuredOutput.kind -> llguidance's grammar format
_FORMATS = {"json_schema": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
# JSON as json.dumps writes it (`{"a": 1, "b": [2, 3]}`): llguidance's flexible whitespace let SmolLM2
# fill a nested array with newlines until max_tokens. A schema's own "x-guidance" options win.
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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
            if spec.kind == "json_schema":  # JSON's separators fixed: no runs of free whitespace
                return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=_JSON_DEFAULTS)
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

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more."""
        return self.matcher.is_stopped()

    def fork(self, token_ids: list[int]) -> Grammar:
        """A copy of this grammar that has consumed ``token_ids`` (a speculative draft's
        rows); this one is unchanged."""
        other = Grammar(self.matcher.deep_copy(), self.vocab_size)
        for t in token_ids:
            other.consume(t)
        return other

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` the grammar allows in a row from here (it is
        unchanged): a draft is cut there."""
        if self.done:
            return 0
        return self.matcher.validate_tokens(token_ids)

    def consume(self, token_id: int) -> None:
        """Advance past a token the sequence produced; ``InvalidRequest`` if the grammar
        does not allow it (a token chosen under this grammar's mask always is). Tokens
        after the grammar is done (an EOS) change nothing."""
        if self.done:
            return
        if not self.matcher.consume_token(token_id):
            raise InvalidRequest(f"token {token_id} breaks the structured output: {self.matcher.get_error()}")
