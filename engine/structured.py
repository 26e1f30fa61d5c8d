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

import numpy as np
import torch

from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import StructuredOutput

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


def allows(grammars: list[Grammar], tokens: torch.Tensor) -> list[bool]:
    """Whether each grammar allows its token next (``tokens``: one per grammar)."""
    bitmask = _bitmasks(grammars)
    return [bool((int(bitmask[i, t >> 5]) >> (t & 31)) & 1) for i, t in enumerate(tokens.tolist())]


def _bitmasks(grammars: list[Grammar]) -> torch.Tensor:
    """[len(grammars), words] int32: the tokens each grammar allows next, 32 per word
    (token ``32 * w + b`` is bit ``b`` of word ``w``), filled by llguidance (the rows in
    parallel)."""
    import llguidance.torch

    global _EXECUTOR
    vocab = grammars[0].vocab_size  # one tokenizer per engine
    bitmask = torch.zeros(len(grammars), (vocab + 31) // 32, dtype=torch.int32)
    if len(grammars) == 1:
        llguidance.torch.fill_next_token_bitmask(grammars[0].matcher, bitmask, 0)
    else:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        matchers = [(g.matcher, i) for i, g in enumerate(grammars)]
        llguidance.torch.fill_next_token_bitmask_par(_EXECUTOR, matchers, bitmask)
    return bitmask


def allowed_tokens(grammars: list[Grammar], width: int, device: torch.device) -> torch.Tensor:
    """[len(grammars), width] bool: the tokens each grammar allows next (False past the
    tokenizer's vocabulary). The bitmask is unpacked here rather than with
    ``llguidance.torch.apply_token_bitmask_inplace``, which compiles a kernel with
    ``torch.compile`` on the CPU."""
    vocab = grammars[0].vocab_size
    bitmask = _bitmasks(grammars)
    # little-endian words: byte k of a row holds tokens 8k..8k+7, lowest bit first
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    bits = torch.from_numpy(bits).view(torch.bool).to(device)  # 0/1 bytes are bools already
    if width > vocab:
        bits = torch.cat([bits, bits.new_zeros(len(grammars), width - vocab)], dim=1)
    return bits[:, :width]


_EXECUTOR = None  # llguidance's thread pool for filling many rows' masks at once
