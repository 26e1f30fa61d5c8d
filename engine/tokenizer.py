"""Tokenizer, chat template and incremental detokenization, through transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from splitserve.wire.chat import ChatTemplating
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import StructuredOutput

if TYPE_CHECKING:
    from splitserve.engine.structured import Grammar, GrammarCompiler


class Tokenizer:
    """Thin wrapper over a Hugging Face tokenizer with the operations the engine uses."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self._grammars: GrammarCompiler | None = None  # built on first use; not pickled

    def __getstate__(self) -> dict:
        return {"hf": self.hf, "_grammars": None}

    def grammar(self, spec: StructuredOutput, output_token_ids: list[int] = ()) -> Grammar:
        """A structured-output matcher for ``spec`` past ``output_token_ids``
        (``engine.structured``); ``InvalidRequest`` for a spec it cannot use."""
        if self._grammars is None:
            from splitserve.engine.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.hf)
        return self._grammars.grammar(spec, output_token_ids)

    @classmethod
    def from_source(cls, directory: str, **kwargs: Any) -> Tokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(directory, **kwargs))

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        # Chat-templated text already carries its special tokens; raw prompts get
        # whatever the tokenizer adds by default (e.g. BOS for Llama).
        return self.hf.encode(text)

    def encode_plain(self, text: str) -> list[int]:
        """``text``'s tokens without the special tokens ``encode`` adds (a BOS)."""
        return self.hf.encode(text, add_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], templating: ChatTemplating | None = None
    ) -> list[int]:
        """The prompt of ``messages`` with the generation prompt added, rendered by
        ``templating``'s template (else the model's) with its tools and variables."""
        templating = templating or ChatTemplating()
        if not (templating.template or getattr(self.hf, "chat_template", None)):
            raise InvalidRequest("this model has no chat template; send a raw prompt instead")
        from jinja2 import TemplateError

        try:
            out = self.hf.apply_chat_template(
                messages,
                tools=templating.tools,
                chat_template=templating.template,
                add_generation_prompt=True,
                tokenize=True,
                **templating.variables,
            )
        except TemplateError as e:  # e.g. roles that must alternate; the template's own words
            raise InvalidRequest(f"the model's chat template refused these messages: {e}") from None
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (special tokens included, as logprobs show them)."""
        return self.hf.convert_tokens_to_string([self.hf.convert_ids_to_tokens(token_id)])


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without re-decoding everything.

    Decodes a short window (``prefix_offset:``) and emits what lies beyond the
    already-emitted part (``prefix_offset:read_offset``); holds text back while
    it ends in an incomplete UTF-8 sequence (U+FFFD).

    Where a Rust ``tokenizers.Tokenizer`` decodes for the tokenizer and no spaces are
    cleaned up after (``clean_up_tokenization_spaces``), the same algorithm runs there
    (``tokenizers.decoders.DecodeStream``): SmolLM2's tokenizer took 2.2 us a token
    against 17.6 for the two Python decodes, with the same text (session 48, a 2-vCPU
    Xeon); the interpreter, which the engine's step shares, is held that much less.
    """

    WINDOW = 5

    def __init__(
        self, tokenizer: Tokenizer, token_ids: list[int], num_emitted: int, skip_special_tokens: bool = True
    ):
        """``token_ids``: the first ``num_emitted`` (at least) are the text's context,
        never emitted; ``step`` is then given the list as it grows."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.read_offset = num_emitted
        self.prefix_offset = max(0, num_emitted - self.WINDOW)
        context = token_ids[self.prefix_offset : num_emitted]
        self._rust, self._stream = _decode_stream(tokenizer, context, skip_special_tokens)
        self._fed = num_emitted  # tokens the stream has seen

    def step(self, token_ids: list[int]) -> str:
        """The text that ``token_ids`` (the list given before, grown) adds, or "" while
        none is complete."""
        if self._stream is not None:
            new, self._fed = token_ids[self._fed :], len(token_ids)
            if not new:
                return ""
            return self._stream.step(self._rust, new) or ""

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, self.skip_special_tokens)

        prefix = decode(token_ids[self.prefix_offset : self.read_offset])
        full = decode(token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
            return full[len(prefix) :]
        return ""


def _decode_stream(tokenizer: Tokenizer, context: list[int], skip_special_tokens: bool) -> tuple[Any, Any]:
    """(Rust tokenizer, ``DecodeStream`` past ``context``) where ``IncrementalDetokenizer``
    may use them (see its docstring), else (None, None)."""
    hf = tokenizer.hf
    rust = getattr(hf, "_tokenizer", None)
    if getattr(hf, "clean_up_tokenization_spaces", False):
        return None, None
    try:
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers.decoders import DecodeStream

        if not isinstance(rust, RustTokenizer):
            return None, None
        return rust, DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):  # a tokenizers release without DecodeStream(ids=...)
        return None, None
