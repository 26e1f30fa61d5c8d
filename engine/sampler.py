"""Token sampling for a batch of rows with per-row parameters.

Rows that ask for logits processing (``SamplingParams.processes_logits``: allowed
tokens, ``min_tokens``, ``logit_bias``, repetition / frequency / presence
penalties) get it first, greedy rows too, in ``SamplingParams``' documented
order; each row's inputs are its own tokens, so a row's result never depends on
the batch. Then greedy rows take the argmax. Other rows: logits / temperature,
then top-k, top-p and min-p filters, then one draw by the exponential-race trick
(argmax of p / E with E ~ Exp(1)), which equals sampling from p. Seeded rows
draw their noise from a generator seeded with ``(seed, index of the token being
generated)``, so a seeded request reproduces exactly whatever else is in the
batch and whichever worker samples each token. Logprobs (the chosen token's, and
the top-N's) are under the unmodified distribution (log_softmax of the raw logits).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from splitserve.engine.structured import Grammar
from splitserve.engine.structured_masks import allowed_tokens, allows
from splitserve.wire.outputs import TopLogprobs
from splitserve.wire.sampling import SamplingParams


@dataclass(frozen=True)
class SampleRequest:
    params: SamplingParams
    output_index: int  # how many tokens this sequence has generated before this one
    token_ids: list[int] | None = None  # prompt then output tokens so far (needed when processing)
    num_prompt_tokens: int = 0
    grammar: Grammar | None = None  # structured output: what it allows next


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]  # for rows with params.top_logprobs


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        eos_token_ids: Collection[int] = (),
    ):
        """``argmax``: each row's first index of its maximum, for logits in the model's
        dtype (the native CPU kernel; torch's ``argmax`` by default). ``eos_token_ids``:
        what ``min_tokens`` holds back besides a row's stop token ids."""
        self.generator = torch.Generator().manual_seed(seed)
        self.argmax = argmax or (lambda logits: logits.argmax(dim=-1))
        self.eos_token_ids = tuple(sorted(eos_token_ids))

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SampleResult:
        """``logits``: [len(rows), vocab] in any float dtype, on any device. Greedy rows
        without processing take the argmax of them as they are (a bf16 value's float32
        twin orders the same); other rows are upcast to float32 first."""
        tokens = self.argmax(logits)
        special = [i for i, r in enumerate(rows) if not r.params.greedy or r.params.transforms_logits]
        # A greedy row whose only processing is a grammar keeps its argmax when the grammar
        # allows it (masking only removes tokens): most steps of a model that follows the
        # format. Only the others are masked.
        guided = [
            i
            for i, r in enumerate(rows)
            if r.grammar is not None and r.params.greedy and not r.params.transforms_logits
        ]
        if guided:
            ok = allows([rows[i].grammar for i in guided], tokens.index_select(0, _index(guided, tokens)))
            special = sorted(special + [i for i, fine in zip(guided, ok) if not fine])
        if len(special) == len(rows):  # every row: one float32 copy of them all (never the model's own)
            tokens = self._pick(self.process(logits.to(torch.float32, copy=True), rows), rows)
        elif special:
            idx = _index(special, logits)
            picked = [rows[i] for i in special]
            tokens[idx] = self._pick(self.process(logits.index_select(0, idx).float(), picked), picked)
        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * len(rows)
        top: list[TopLogprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs]
        if want:
            idx = torch.tensor(want, device=logits.device)
            lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
            chosen = lp.gather(1, tokens.index_select(0, idx)[:, None]).squeeze(1).tolist()
            n = max(rows[i].params.top_logprobs for i in want)
            best = lp.topk(n, dim=-1) if n else None
            for j, (i, v) in enumerate(zip(want, chosen)):
                logprobs[i] = v
                if k := rows[i].params.top_logprobs:
                    ids, values = best.indices[j, :k].tolist(), best.values[j, :k].tolist()
                    top[i] = tuple(zip(ids, values))
        return SampleResult(token_list, logprobs, top)

    def process(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """``logits`` (float32, one row per request) after each row's processing, in
        place; rows without any are left as they are."""
        structured = [i for i, r in enumerate(rows) if r.grammar is not None]
        if structured:
            refused = allowed_tokens([rows[i].grammar for i in structured], logits.shape[1], logits.device)
            refused.logical_not_()
            if len(structured) == len(rows):
                logits.masked_fill_(refused, float("-inf"))
            else:
                idx = torch.tensor(structured, device=logits.device)
                logits[idx] = logits.index_select(0, idx).masked_fill_(refused, float("-inf"))
        for i, r in enumerate(rows):
            p = r.params
            if not p.transforms_logits:
                continue
            row = logits[i]
            if p.allowed_token_ids is not None:
                keep = torch.full_like(row, float("-inf"))
                keep[list(p.allowed_token_ids)] = 0.0
                row += keep
            if p.bad_words_ids:
                output = r.token_ids[r.num_prompt_tokens :] if r.token_ids is not None else []
                banned = [
                    w[-1] for w in p.bad_words_ids if len(w) == 1 or output[-(len(w) - 1) :] == list(w[:-1])
                ]
                if banned:
                    row[banned] = float("-inf")
            if r.output_index < p.min_tokens:
                held = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]
                if held:
                    row[held] = float("-inf")
            if p.logit_bias:
                ids = [t for t, _ in p.logit_bias]
                row[ids] += torch.tensor([b for _, b in p.logit_bias], device=row.device)
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                self._penalize(row, r)
        return logits

    @staticmethod
    def _penalize(row: torch.Tensor, r: SampleRequest) -> None:
        p, device = r.params, row.device
        if r.token_ids is None:
            raise ValueError("penalties need the row's token ids")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        output = r.token_ids[r.num_prompt_tokens :]
        if output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(output, device=device), minlength=row.shape[0]).to(row.dtype)
            row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty

    def _pick(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """Each row's token from its processed float32 logits: the argmax for greedy rows,
        a draw for the others."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            tokens[idx] = self._sample(logits.index_select(0, idx), [rows[i] for i in sampled])
        return tokens

    def _sample(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        logits = logits / temps[:, None]
        top_ks = [r.params.top_k for r in rows]
        if any(top_ks):
            vocab = logits.shape[1]
            k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).clamp(max=vocab - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = [r.params.top_p for r in rows]
        if any(p < 1.0 for p in top_ps):
            p = torch.tensor(top_ps, device=logits.device)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the mass before it already reaches top_p (the first always stays).
            drop = (probs.cumsum(dim=-1) - probs) >= p[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_ps = [r.params.min_p for r in rows]
        if any(min_ps):
            floor = (
                probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, device=probs.device)[:, None]
            )
            probs = probs.masked_fill(probs < floor, 0.0)
        shared = self.generator if probs.device.type == "cpu" else None
        noise = torch.empty_like(probs).exponential_(generator=shared)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator(device=probs.device).manual_seed(_row_seed(r.params.seed, r.output_index))
                noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, device=like.device)


def _row_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF
