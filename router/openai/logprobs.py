"""OpenAI's ``logprobs`` object of a choice, from the tokens a request produced.

Chat (``logprobs: true``, ``top_logprobs: N``)::

    {"content": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                  "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}, ...]}]}

Completions (``logprobs: N``: the chosen token's and the N most likely)::

    {"tokens": ["Hi"], "token_logprobs": [-0.1], "top_logprobs": [{"Hi": -0.1, ...}], "text_offset": [0]}

A token's text is the tokenizer's for it alone; without a tokenizer it is
``token_id:ID`` (vLLM's ``return_tokens_as_token_ids`` form). Logprobs are of
the model's unmodified distribution (``engine.sampler``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splitserve.wire.outputs import PromptLogprob, TopLogprobs


class LogprobsWriter:
    """Builds one choice's ``logprobs`` from its tokens, in order (a stream's chunks
    one after another: completions' ``text_offset`` continues across them)."""

    def __init__(self, chat: bool, token_text: Callable[[int], str]):
        self.chat = chat
        self.token_text = token_text
        self.offset = 0  # characters of completion text before the next token

    def write(self, token_ids: list[int], logprobs: list[float], top: list[TopLogprobs]) -> dict[str, Any]:
        tops = top if top else [()] * len(token_ids)
        if self.chat:
            content = [
                self._entry(t, lp) | {"top_logprobs": [self._entry(u, v) for u, v in best]}
                for t, lp, best in zip(token_ids, logprobs, tops)
            ]
            return {"content": content}
        texts = [self.token_text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": list(logprobs),
            "top_logprobs": [{self.token_text(u): v for u, v in best} for best in tops] if top else None,
            "text_offset": offsets,
        }

    def write_prompt(self, token_ids: list[int], prompt_logprobs: list[PromptLogprob]) -> dict[str, Any]:
        """Completions with ``echo``: the prompt's part, as ``write`` gives the output's
        (the first prompt token has no logprob: ``None``)."""
        texts = [self.token_text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        top = [{self.token_text(u): v for u, v in best} for _, best in prompt_logprobs]
        return {
            "tokens": texts,
            "token_logprobs": [None] + [lp for lp, _ in prompt_logprobs],
            "top_logprobs": [None, *top],
            "text_offset": offsets,
        }

    @staticmethod
    def join(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
        """Two completions-shaped parts as one (the prompt's, then the output's)."""
        n = len(then["tokens"])
        return {
            "tokens": first["tokens"] + then["tokens"],
            "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + (then["top_logprobs"] or [{}] * n),
            "text_offset": first["text_offset"] + then["text_offset"],
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def vllm_prompt_logprobs(
    token_ids: list[int], prompt_logprobs: list[PromptLogprob], token_text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token (the first: ``None``),
    token id (as text) -> ``{"logprob", "rank", "decoded_token"}`` for the token itself
    and the most likely ones at its position (rank 1 = most likely; the prompt token's
    rank is known only when it is among them, else ``None``)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, (logprob, best) in zip(token_ids[1:], prompt_logprobs):
        ranks = {t: r for r, (t, _) in enumerate(best, 1)}
        entry = {
            str(token): {"logprob": logprob, "rank": ranks.get(token), "decoded_token": token_text(token)}
        }
        for t, v in best:
            entry.setdefault(str(t), {"logprob": v, "rank": ranks[t], "decoded_token": token_text(t)})
        out.append(entry)
    return out
