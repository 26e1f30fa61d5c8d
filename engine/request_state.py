"""Per-request state in the engine: its stop conditions by token, its output deltas
(token ids; text is made off the step: ``engine.text``)."""

from __future__ import annotations

from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.speculative.adaptive import Acceptance
from splitserve.engine.text import text_start
from splitserve.wire.errors import SequenceFailed
from splitserve.wire.outputs import CompletionOutput, PromptLogprob, RequestOutput, TextStart, TopLogprobs
from splitserve.wire.sampling import FinishReason


class RequestState:
    """Wraps a ``Sequence``. ``num_emitted`` tokens (the prompt, plus a first token
    sampled elsewhere for imported requests) are never re-emitted; its first output
    carries what making its text needs (``TextStart``)."""

    def __init__(self, seq: Sequence, num_emitted: int):
        self.seq = seq
        self._text_start: TextStart | None = text_start(
            seq.token_ids, seq.num_prompt_tokens, num_emitted, seq.params
        )
        self._sent_prompt_logprobs = False
        self.stop_token = False  # it ended at an EOS or stop token id
        self.error: SequenceFailed | None = None  # it failed alone (``Engine._fail``)
        # its speculation here (``engine.speculative``): set when it first may speculate
        self.acceptance: Acceptance | None = None

    def check_stop(self, eos_token_ids: set[int], max_model_len: int) -> FinishReason | None:
        """Why the request ends at the token just appended, if it does (stop strings are
        ``engine.text``'s: they need its text)."""
        seq, params = self.seq, self.seq.params
        token = seq.token_ids[-1]
        if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
            self.stop_token = True
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
        start, self._text_start = self._text_start, None
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            text="",
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
            text_start=start,
            stop_token=finished and self.stop_token,
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

    def completion(self, text: str, last: RequestOutput | None = None) -> CompletionOutput:
        """The finished request with its ``text`` (made by ``engine.text``), as its ``last``
        output ended it (its tokens cut and its reason ``STOP`` where the text ended at a
        stop string; None: as the engine ended it)."""
        seq = self.seq
        n = seq.num_output_tokens if last is None else last.num_output_tokens
        reason = seq.finish_reason if last is None else last.finish_reason
        return CompletionOutput(
            seq.request_id,
            list(seq.prompt_token_ids),
            seq.output_token_ids[:n],
            text,
            reason,
            seq.num_cached_tokens,
            list(seq.logprobs[:n]),
            list(seq.top_logprobs[:n]),
            list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
            self.error if last is None else last.error,
        )
