"""Per-request output state: incremental text, stop conditions, output deltas."""

from __future__ import annotations

from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.speculative.adaptive import Acceptance
from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from splitserve.wire.errors import SequenceFailed
from splitserve.wire.outputs import CompletionOutput, PromptLogprob, RequestOutput, TopLogprobs
from splitserve.wire.sampling import FinishReason


class RequestState:
    """Wraps a ``Sequence`` with its text. ``num_emitted`` tokens (the prompt, plus a
    first token sampled elsewhere for imported requests) are never re-emitted."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer | None, num_emitted: int):
        self.seq = seq
        skip = seq.params.skip_special_tokens
        self.detok = (
            IncrementalDetokenizer(tokenizer, seq.token_ids, num_emitted, skip) if tokenizer else None
        )
        # Text of tokens emitted before this engine saw the request (context for stop strings).
        done = seq.token_ids[seq.num_prompt_tokens : num_emitted]
        self.text = tokenizer.decode(done, skip) if tokenizer else ""
        self.emitted_chars = len(self.text)
        self._sent_prompt_logprobs = False
        stops = seq.params.stop
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.error: SequenceFailed | None = None  # it failed alone (``Engine._fail``)
        # its speculation here (``engine.speculative``): set when it first may speculate
        self.acceptance: Acceptance | None = None

    def update_text_and_check_stop(self, eos_token_ids: set[int], max_model_len: int) -> FinishReason | None:
        """Account for the token just appended; return why the request ends, if it does."""
        seq, params = self.seq, self.seq.params
        token = seq.token_ids[-1]
        if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
            # the stop token's own text only when asked (vLLM's include_stop_str_in_output)
            if params.include_stop_str_in_output and self.detok is not None:
                self.text += self.detok.step(seq.token_ids)
            return FinishReason.STOP
        if self.detok is not None:
            before = len(self.text)
            self.text += self.detok.step(seq.token_ids)
            if params.stop:
                start = max(0, before - self.holdback)
                hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in params.stop) if i >= 0]
                if hits:
                    at, stop = min(hits)
                    self.text = self.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                    return FinishReason.STOP
        if seq.grammar is not None and seq.grammar.done:  # the structured output is complete
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def output(
        self,
        new_token_ids: list[int],
        new_logprobs: list[float] | None = None,
        new_top_logprobs: list[TopLogprobs] | None = None,
    ) -> RequestOutput:
        seq = self.seq
        finished = seq.status in (SequenceStatus.FINISHED, SequenceStatus.PREFILLED)
        # While running, hold back a tail that could be the start of a stop string.
        end = len(self.text) if finished else max(self.emitted_chars, len(self.text) - self.holdback)
        delta = self.text[self.emitted_chars : end]
        self.emitted_chars = end
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            text=delta,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=new_logprobs or [],
            new_top_logprobs=new_top_logprobs or [],
            prompt_logprobs=self._prompt_logprobs_once(),
            scheduled_at=seq.scheduled_at,
            draft_tokens=self.acceptance.proposed if self.acceptance is not None else 0,
            accepted_draft_tokens=self.acceptance.accepted if self.acceptance is not None else 0,
        )

    def _prompt_logprobs_once(self) -> list[PromptLogprob] | None:
        """The prompt's logprobs, on the first output that has them all (then never again)."""
        seq = self.seq
        if seq.params.prompt_logprobs is None or self._sent_prompt_logprobs:
            return None
        if len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
            return None
        self._sent_prompt_logprobs = True
        return list(seq.prompt_logprobs)

    def completion(self) -> CompletionOutput:
        seq = self.seq
        return CompletionOutput(
            seq.request_id,
            list(seq.prompt_token_ids),
            seq.output_token_ids,
            self.text,
            seq.finish_reason,
            seq.num_cached_tokens,
            list(seq.logprobs),
            list(seq.top_logprobs),
            list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
            self.error,
        )
