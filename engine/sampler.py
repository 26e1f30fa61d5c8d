"""Token sampling for a batch of rows with per-row parameters.

Per row, in ``SamplingParams``' documented order: logits processing for rows that
ask for it (allowed tokens, bad words, ``min_tokens``, ``logit_bias``, repetition /
frequency / presence penalties), greedy rows too; each row's inputs are its own
tokens, so a row's result never depends on the batch. Sampled rows are divided by
their temperature (at least ``MIN_TEMPERATURE``). Then every processed row is made
safe: NaN logits masked, infinite ones made finite, and last of all its grammar's
mask applied (structured output), so nothing before can bring back a token the
grammar forbids. Greedy rows take the argmax; the others go through top-k, top-p
and min-p, then one draw by the exponential-race trick (argmax of p / E with
E ~ Exp(1), drawn as -log U: a sixth of ``exponential_``'s time here), which
equals sampling from p. Top-k takes each row's k-th logit from a ``topk``, and
top-p needs only each row's sorted probabilities (``_top_p``), sorted by numpy on
the CPU: torch's sort with indices of a 49k vocabulary cost ten times a step's
other sampling work on these CPUs. Seeded rows draw their noise from a
generator seeded with ``(seed, index of the token being generated)``, so a seeded
request reproduces exactly whatever else is in the batch and whichever worker
samples each token. Logprobs (the chosen token's, and the top-N's) are under the
unmodified distribution (log_softmax of the raw logits).

A row that cannot be sampled fails alone (``SampleResult.failed``): left with no
token to pick (``Unsampleable``: its own constraints exclude everything), or
raising while it is sampled (``SequenceFailed``: the batch is sampled again row
by row to find which). The other rows' tokens are what they would have been.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve.engine.structured import Grammar
from splitserve.engine.structured_masks import allowed_tokens, allows
from splitserve.wire.errors import SequenceFailed, Unsampleable
from splitserve.wire.outputs import TopLogprobs
from splitserve.wire.sampling import MIN_TEMPERATURE, SamplingParams

log = logging.getLogger(__name__)
# what an infinite logit becomes: finite, and far above any real one
_FINITE = 1e30


@dataclass(frozen=True)
class SampleRequest:
    params: SamplingParams
    output_index: int  # how many tokens this sequence has generated before this one
    token_ids: list[int] | None = None  # prompt then output tokens so far (needed when processing)
    num_prompt_tokens: int = 0
    grammar: Grammar | None = None  # structured output: what it allows next


@dataclass
class SampleResult:
    token_ids: list[int]  # -1 for a failed row
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]  # for rows with params.top_logprobs
    failed: dict[int, SequenceFailed] = field(default_factory=dict)  # row -> why it has no token


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
        twin orders the same); other rows are upcast to float32 first. Never raises for
        a row's sake: a row that fails is in ``failed`` (see the module docstring)."""
        try:
            return self._sample_batch(logits, rows)
        except Exception as e:  # one row's parameters or grammar: find it, sample the rest alone
            if len(rows) == 1:
                log.warning("sampling a row failed: %r", e)
                return SampleResult([-1], [None], [None], {0: _failure(e)})
            log.warning("sampling a batch of %d failed (%r); sampling its rows one by one", len(rows), e)
        out = SampleResult([], [], [], {})
        for i, row in enumerate(rows):
            one = self(logits[i : i + 1], [row])
            out.token_ids += one.token_ids
            out.logprobs += one.logprobs
            out.top_logprobs += one.top_logprobs
            if 0 in one.failed:
                out.failed[i] = one.failed[0]
        return out

    def _sample_batch(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SampleResult:
        special = [i for i, r in enumerate(rows) if not r.params.greedy or r.params.transforms_logits]
        # every row sampled or processed: no argmax of the raw logits is kept
        tokens = self.argmax(logits) if len(special) < len(rows) else None
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
        failed: dict[int, SequenceFailed] = {}
        if len(special) == len(rows):  # every row: one float32 copy of them all (never the model's own)
            tokens, failed = self._pick(logits.to(torch.float32, copy=True), rows)
        elif special:
            idx = _index(special, logits)
            picked, empty = self._pick(logits.index_select(0, idx).float(), [rows[i] for i in special])
            tokens[idx] = picked
            failed = {special[j]: e for j, e in empty.items()}
        for i in failed:
            tokens[i] = 0  # a placeholder for the logprobs below; the row's token is -1
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
        for i in failed:
            token_list[i], logprobs[i], top[i] = -1, None, None
        return SampleResult(token_list, logprobs, top, failed)

    def process(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """``logits`` (float32, one row per request) after each row's logits processing
        (allowed tokens to penalties, not the grammar: ``_pick`` masks it last), in
        place; rows without any are left as they are."""
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

    def _pick(
        self, logits: torch.Tensor, rows: list[SampleRequest]
    ) -> tuple[torch.Tensor, dict[int, SequenceFailed]]:
        """Each row's token from its float32 logits (changed in place): processed, divided
        by the temperature (sampled rows), made safe (NaN masked, infinities finite),
        masked by its grammar last, then the argmax for greedy rows and a draw for the
        others. Rows left with no token to pick are returned as failed (token 0)."""
        raw_nan = _all_nan(logits)
        self.process(logits, rows)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        every = len(sampled) == len(rows)  # no copies of the rows picked out
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            temps = torch.tensor(
                [max(rows[i].params.temperature, MIN_TEMPERATURE) for i in sampled], device=logits.device
            )
            if every:
                logits.div_(temps[:, None])
            else:
                logits[idx] = logits.index_select(0, idx) / temps[:, None]
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=_FINITE, neginf=float("-inf"))
        self._mask_grammars(logits, rows)
        empty = logits.amax(dim=-1) == float("-inf")
        failed = {i: _unsampleable(rows[i], bool(raw_nan[i])) for i in empty.nonzero().flatten().tolist()}
        if failed:
            logits[empty] = 0.0  # any token: the row's is dropped
        if every:
            return self._sample(logits, rows), failed
        tokens = logits.argmax(dim=-1)
        if sampled:
            tokens[idx] = self._sample(logits.index_select(0, idx), [rows[i] for i in sampled])
        return tokens, failed

    @staticmethod
    def _mask_grammars(logits: torch.Tensor, rows: list[SampleRequest]) -> None:
        """Mask, in place, the tokens each row's grammar does not allow next."""
        structured = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not structured:
            return
        refused = allowed_tokens([rows[i].grammar for i in structured], logits.shape[1], logits.device)
        refused.logical_not_()
        if len(structured) == len(rows):
            logits.masked_fill_(refused, float("-inf"))
        else:
            idx = torch.tensor(structured, device=logits.device)
            logits[idx] = logits.index_select(0, idx).masked_fill_(refused, float("-inf"))

    def _sample(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """A draw per row from logits already divided by the temperature and masked."""
        vocab = logits.shape[1]
        cut = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab]
        if cut:  # each row's k-th largest logit, from a top-k of the largest k (no full sort)
            idx = _index(cut, logits)
            k = torch.tensor([rows[i].params.top_k for i in cut], device=logits.device)
            sub = logits.index_select(0, idx)
            kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
            masked = sub.masked_fill(sub < kth, -_INF)
            if len(cut) == len(rows):
                logits = masked
            else:
                logits = logits.clone()
                logits[idx] = masked
        nucleus = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
        if nucleus:
            logits = _top_p(logits, nucleus, [rows[i].params.top_p for i in nucleus])
        probs = logits.softmax(dim=-1)
        min_ps = [r.params.min_p for r in rows]
        if any(min_ps):
            floor = (
                probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, device=probs.device)[:, None]
            )
            probs = probs.masked_fill(probs < floor, 0.0)
        # E ~ Exp(1) as -log(U), U ~ U[0, 1): a sixth of exponential_'s time on these CPUs
        noise = torch.empty_like(probs)
        shared = self.generator if probs.device.type == "cpu" else None
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        if len(seeded) < len(rows):
            noise.uniform_(generator=shared)
        for i in seeded:
            r = rows[i]
            g = torch.Generator(device=probs.device).manual_seed(_row_seed(r.params.seed, r.output_index))
            noise[i].uniform_(generator=g)
        # U >= the smallest normal float: E is finite, so a token of probability 0 never
        # wins (a row's only token drawing U = 0 would leave every ratio 0, and argmax 0)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise.log_().neg_()).argmax(dim=-1)


_INF = float("inf")


def _top_p(logits: torch.Tensor, rows: list[int], top_ps: list[float]) -> torch.Tensor:
    """``logits`` with each of ``rows``' tokens outside its nucleus masked: a token
    stays when the tokens more likely than it hold less than the row's top_p of the
    mass (the likeliest always stays: a top_p below float32's smallest value is 0
    here). In descending order that is the prefix up to the first token whose mass
    before it reaches top_p, and all the tokens as likely as its last one: so only the
    sorted probabilities are needed (no argsort), and tokens tied at the edge stay or
    go together."""
    idx = _index(rows, logits)
    sub = logits.index_select(0, idx)
    p = torch.tensor(top_ps, device=logits.device)[:, None]
    probs = sub.softmax(dim=-1)
    ascending = _sorted(probs)
    cum = ascending.cumsum(dim=-1)
    above = cum[:, -1:] - cum  # the mass after each in ascending order: before it, descending
    kept = (above < p).sum(dim=-1, keepdim=True).clamp(min=1)
    edge = ascending.gather(1, probs.shape[1] - kept)  # the least likely token kept
    masked = sub.masked_fill(probs < edge, -_INF)
    if len(rows) == logits.shape[0]:
        return masked
    out = logits.clone()
    out[idx] = masked
    return out


def _sorted(x: torch.Tensor) -> torch.Tensor:
    """Each row's values in ascending order. A float32 CPU tensor is sorted by numpy:
    1.5 ms for 16 x 49,152 here, against 24 ms for torch's (numpy has no bfloat16, and
    a GPU sorts fast: those take torch's)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return x.sort(dim=-1).values
    return torch.from_numpy(np.sort(x.numpy(), axis=-1))


def _all_nan(logits: torch.Tensor) -> torch.Tensor:
    """Per row, whether every logit is NaN: looked for only in rows whose maximum is
    NaN (torch's max passes a NaN on), so a batch without NaN costs one reduction."""
    out = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    some = logits.amax(dim=-1).isnan()
    if bool(some.any()):
        out[some] = torch.isnan(logits[some]).all(dim=-1)
    return out


def _unsampleable(row: SampleRequest, nan: bool) -> Unsampleable:
    if nan:
        return Unsampleable("the model's scores for this request's next token were not numbers")
    what = "its structured output's grammar, " if row.grammar is not None else ""
    return Unsampleable(
        f"no token can be sampled after {row.output_index} generated: the request's constraints "
        f"({what}allowed tokens, bad words, min_tokens, logit_bias, penalties) exclude every token"
    )


def _failure(error: Exception) -> SequenceFailed:
    if isinstance(error, SequenceFailed):
        return error
    return SequenceFailed("sampling", f"sampling this request's next token failed ({type(error).__name__})")


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, device=like.device)


def _row_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF
