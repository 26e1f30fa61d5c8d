"""Speculative sampling keeps the target's distribution: over a 6-token vocabulary,
the first two tokens generated with drafts checked by the engine's rule
(``speculative.verify.kept`` over rows drawn by the engine's ``Sampler``) follow the
target's exact joint distribution (chi-square, alpha 1e-4, 20,000 draws), and two
broken rules fail the same test. The target is a bigram table (the next token's
logits depend on the token before); the proposer a different one, whose argmax is
often wrong."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.engine.sampler import Sampler, SampleRequest
from splitserve.engine.speculative.verify import kept
from splitserve.wire.sampling import SamplingParams

VOCAB, DRAWS, K, FIRST = 6, 20_000, 2, 3
g = torch.Generator().manual_seed(7)
TARGET = torch.randn(VOCAB, VOCAB, generator=g) * 1.5  # row: logits of the token after that one
DRAFTER = TARGET + torch.randn(VOCAB, VOCAB, generator=g) * 1.5  # a proposer that is often wrong
PARAMS = SamplingParams(temperature=1.0, max_tokens=8)


def _draft(last: int) -> list[int]:
    out = []
    for _ in range(K):
        last = int(DRAFTER[last].argmax())
        out.append(last)
    return out


def _generate(rule) -> list[tuple[int, int]]:
    """DRAWS runs of speculative decoding from token FIRST until two tokens are kept:
    the pairs. Each round samples every unfinished run's rows in one ``Sampler`` call;
    ``rule(samples, draft, contexts)`` gives the tokens a run keeps of a round."""
    sampler = Sampler(seed=1)
    runs: list[list[int]] = [[] for _ in range(DRAWS)]
    while pending := [i for i, r in enumerate(runs) if len(r) < 2]:
        drafts, rows = [], []
        for i in pending:
            last = runs[i][-1] if runs[i] else FIRST
            draft = _draft(last)
            drafts.append(draft)
            rows += [TARGET[t] for t in [last, *draft]]  # row j: the token after draft[:j]
        requests = [SampleRequest(PARAMS, 0)] * len(rows)
        samples = sampler(torch.stack(rows), requests).token_ids
        for n, (i, draft) in enumerate(zip(pending, drafts)):
            row_samples = samples[n * (K + 1) : (n + 1) * (K + 1)]
            runs[i] += rule(row_samples, draft, [runs[i][-1] if runs[i] else FIRST, *draft])
    return [(r[0], r[1]) for r in runs]


def _chi_square(pairs: list[tuple[int, int]]) -> tuple[float, float]:
    """(statistic, critical value at alpha 1e-4) of the pairs against the target's joint
    p(a | FIRST) p(b | a); the critical value by Wilson-Hilferty."""
    p = TARGET.softmax(dim=-1).double()
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for a, b in pairs:
        counts[a, b] += 1
    expected = p[FIRST][:, None] * p * len(pairs)
    stat = float(((counts - expected) ** 2 / expected).sum())
    df, z = VOCAB * VOCAB - 1, 3.719  # z of 1e-4, one-sided
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_kept_tokens_follow_the_target_distribution():
    stat, critical = _chi_square(_generate(lambda samples, draft, _: samples[: kept(samples, draft)]))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


def _keep_likely_drafts(samples, draft, contexts):
    """Broken: a draft token the target finds likely (p >= 0.2) is kept whatever its
    row drew; the others as the engine does."""
    out = []
    for j, d in enumerate(draft):
        if TARGET[contexts[j]].softmax(-1)[d] >= 0.2 or samples[j] == d:
            out.append(d)
        else:
            return out + [samples[j]]
    return out + [samples[-1]]


def _keep_whole_draft(samples, draft, contexts):
    """Broken: drafts are always right (the target only adds its bonus token)."""
    return draft + [samples[-1]]


@pytest.mark.parametrize("rule", [_keep_likely_drafts, _keep_whole_draft])
def test_a_broken_acceptance_rule_fails_the_same_test(rule):
    stat, critical = _chi_square(_generate(rule))
    assert stat > critical, f"chi-square {stat:.1f} <= {critical:.1f}: the test cannot tell"
