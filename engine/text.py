"""A request's text, made from its token ids off the engine's step: incremental
detokenisation and stop strings (as vLLM's output processor; ARCHITECTURE: the step
emits token ids).

The engine's step (``Engine.step_tokens``) appends tokens and ends a request at an EOS
or stop token id, its length or its grammar's end; it makes no text. A request's first
output from an engine carries its ``TextStart``. Whoever consumes the outputs feeds
each request's outputs, in order, to its ``TextStream`` (``Texts`` keeps them by
request), which fills ``out.text`` and, where a stop string ends, cuts the output after
the token that completed it and finishes it (``STOP``). The engine does not know: the
consumer ends the request there. A worker aborts it in the engine, which may already run
it one more step (what that step sampled is dropped with the request); ``Engine.step``
ends it in-line, in the same step, for the library.

Text is held back while it could be the start of a stop string (and, by the
detokeniser, while it ends in an incomplete UTF-8 character); a finished output
flushes it. A consumer that cannot make a request's text (``feed`` raised) fails that
request alone (``contained("detokenization", error)``).
"""

from __future__ import annotations

import dataclasses

from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from splitserve.wire.outputs import EngineStats, RequestOutput, TextStart
from splitserve.wire.sampling import FinishReason, SamplingParams

# prompt tokens before a request's first new token that its first text is decoded with
CONTEXT_TOKENS = IncrementalDetokenizer.WINDOW


def text_start(token_ids: list[int], num_prompt: int, num_emitted: int, params: SamplingParams) -> TextStart:
    """The ``TextStart`` of a request whose first ``num_emitted`` of ``token_ids`` (the
    prompt's ``num_prompt`` and any output tokens emitted elsewhere) are never emitted
    again."""
    lo = max(0, min(num_prompt, num_emitted - CONTEXT_TOKENS))
    return TextStart(
        tuple(token_ids[lo:num_emitted]),
        max(0, num_emitted - num_prompt),
        params.stop,
        params.include_stop_str_in_output,
        params.skip_special_tokens,
    )


class TextStream:
    """One request's text, from its ``TextStart`` on; fed its outputs in order."""

    def __init__(self, tokenizer: Tokenizer, start: TextStart):
        self.ids = list(start.token_ids)
        n = len(self.ids)
        self.detok = IncrementalDetokenizer(tokenizer, self.ids, n, start.skip_special_tokens)
        before = self.ids[n - start.num_output :] if start.num_output else []
        # all its text so far: that of output tokens emitted before (stop strings' context) too
        self.text = tokenizer.decode(before, start.skip_special_tokens) if before else ""
        self.emitted_chars = len(self.text)
        self.stop = start.stop
        self.include_stop = start.include_stop_str_in_output
        self.holdback = max((len(s) for s in start.stop), default=1) - 1

    def feed(self, out: RequestOutput) -> bool:
        """Make ``out.text`` (in place). Returns whether a stop string ended the request
        in this output: it is then finished (``STOP``), its tokens, logprobs and count cut
        after the token that completed the stop string, the text after it dropped (kept
        up to its end with ``include_stop_str_in_output``)."""
        new, last, stopped = out.new_token_ids, len(out.new_token_ids) - 1, False
        for j, token in enumerate(new):
            self.ids.append(token)
            if j == last and out.stop_token:  # its text only when asked, and no stop string
                if self.include_stop:
                    self.text += self.detok.step(self.ids)
                break
            before = len(self.text)
            self.text += self.detok.step(self.ids)
            if self.stop and self._cut_at_stop(before):
                _end_after(out, j + 1)
                stopped = True
                break
        end = len(self.text) if out.finished else max(self.emitted_chars, len(self.text) - self.holdback)
        out.text = self.text[self.emitted_chars : end]
        self.emitted_chars = end
        return stopped

    def _cut_at_stop(self, before: int) -> bool:
        """Whether the text made since ``before`` completed a stop string (the earliest);
        if so, the text ends there."""
        start = max(0, before - self.holdback)
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self.text = self.text[: at + (len(stop) if self.include_stop else 0)]
        return True


def _end_after(out: RequestOutput, keep: int) -> None:
    """Finish ``out`` (``STOP``) after its first ``keep`` new tokens."""
    dropped = len(out.new_token_ids) - keep
    out.new_token_ids = out.new_token_ids[:keep]
    out.new_logprobs = out.new_logprobs[:keep]
    out.new_top_logprobs = out.new_top_logprobs[:keep]
    out.num_output_tokens -= dropped
    out.finished, out.finish_reason, out.stop_token = True, FinishReason.STOP, False


class Texts:
    """The ``TextStream`` of each request whose outputs are fed here: opened by its first
    output (which carries its ``TextStart``), closed by its last (or ``forget``). One
    owner, one thread. With no tokenizer (an engine built without one) it makes no text."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._streams: dict[str, TextStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def feed(self, out: RequestOutput) -> bool:
        """``TextStream.feed`` of ``out``'s request. An output of a request not open here
        and not carrying its ``TextStart`` is a bug of the caller (``KeyError``); whatever
        ``feed`` raises, a finished output closes its stream."""
        if self.tokenizer is None:
            return False
        rid = out.request_id
        stream = self._streams.get(rid)
        if stream is None:
            if out.text_start is None:
                raise KeyError(f"request {rid}'s first output reached its text without its TextStart")
            stream = self._streams[rid] = TextStream(self.tokenizer, out.text_start)
        try:
            return stream.feed(out)
        finally:
            if out.finished:
                del self._streams[rid]

    def forget(self, request_id: str) -> None:
        """Drop a request's stream (it ended without a finished output reaching here)."""
        self._streams.pop(request_id, None)


def with_text_failures(stats: EngineStats, failed: int) -> EngineStats:
    """An engine's ``stats`` with ``failed`` requests whose text its consumer could not
    make counted among those that failed alone (kind ``detokenization``), as they were
    when the engine made text."""
    if not failed:
        return stats
    errors = dict(stats.sequence_errors)
    errors["detokenization"] = errors.get("detokenization", 0) + failed
    return dataclasses.replace(stats, sequence_errors=tuple(sorted(errors.items())))
