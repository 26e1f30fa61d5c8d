"""Token sampling for a batch of rows with per-row parameters.

Greedy rows take the argmax. Other rows: logits / temperature, then top-k and
top-p filters, then one draw by the exponential-race trick (argmax of p / E with
E ~ Exp(1)), which equals sampling from p. Seeded rows draw their noise from a
generator seeded with ``(seed, index of the token being generated)``, so a seeded
request reproduces exactly whatever else is in the batch and whichever worker
samples each token. Logprobs are of the chosen token under the unmodified
distribution (log_softmax of the raw logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.wire.sampling import SamplingParams


@dataclass(frozen=True)
class SampleRequest:
    params: SamplingParams
    output_index: int  # how many tokens this sequence has generated before this one


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]


class Sampler:
    def __init__(self, seed: int = 0, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``argmax``: each row's first index of its maximum, for logits in the model's
        dtype (the native CPU kernel; torch's ``argmax`` by default)."""
        self.generator = torch.Generator().manual_seed(seed)
        self.argmax = argmax or (lambda logits: logits.argmax(dim=-1))

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SampleResult:
        """``logits``: [len(rows), vocab] in any float dtype, on any device. Greedy rows
        take the argmax of them as they are (a bf16 value's float32 twin orders the same);
        rows that sample or want logprobs are upcast to float32 first."""
        tokens = self.argmax(logits)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            tokens[idx] = self._sample(logits.index_select(0, idx).float(), [rows[i] for i in sampled])
        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs]
        if want:
            idx = torch.tensor(want, device=logits.device)
            lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
            chosen = lp.gather(1, tokens.index_select(0, idx)[:, None]).squeeze(1).tolist()
            for i, v in zip(want, chosen):
                logprobs[i] = v
        return SampleResult(token_list, logprobs)

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
        shared = self.generator if probs.device.type == "cpu" else None
        noise = torch.empty_like(probs).exponential_(generator=shared)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator(device=probs.device).manual_seed(_row_seed(r.params.seed, r.output_index))
                noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)


def _row_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF
