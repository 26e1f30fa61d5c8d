"""Model proposers: a draft model decodes greedily on a paged KV cache of its own.

- ``draft``: a smaller model with the target's vocabulary, loaded whole on the
  driver rank (``build_engine`` of its own config: any family the engine loads);
- ``self``: the target's own first layers, its final norm and LM head
  (``DecoderModel.forward(num_layers=...)``, no weights copied), for models with no
  small sibling. Its KV of a request's computed tokens is the target's own in those
  layers: it is copied from the target's cache, never recomputed (``shared``).

**The draft's state is a function of the tokens.** Per request the proposer keeps
the tokens whose KV its cache holds; at each proposal it keeps the longest prefix
that still agrees with the sequence (accepted draft tokens stay, the rest are
overwritten) and runs the draft over the rest (the prompt the first time: the
draft's prompt KV is computed here, on the decode worker, never handed over).
Whatever happened to the sequence in between (preemption, a failover to another
worker, a migration) the next proposal catches up from its tokens alone: no draft
state crosses a process, and prefill workers need no draft at all.

A proposal of k tokens is one draft step over every request's uncomputed tokens
(decodes and catch-up chunks packed together), then k - 1 single-token steps. The
draft decodes greedily: verification keeps the target's own samples
(``speculative.verify``), so any deterministic draft leaves the output distribution
the target's. Driver rank only; the draft is never tensor-parallel.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from splitserve.engine.attention import SeqSpan
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.model_runner import ModelRunner, StepInputs
from splitserve.engine.speculative import ProposalRequest


@dataclass
class _DraftSeq:
    """One request's state in the draft's cache."""

    tokens: list[int] = field(default_factory=list)  # tokens whose KV the draft's cache holds
    blocks: list[int] = field(default_factory=list)
    used: int = 0  # the proposal call that last used it (least recently used is evicted first)


class ModelProposer:
    """Greedy proposals from a draft model run by ``runner`` (its own KV cache of
    ``runner.kv_cache.layout.num_blocks`` blocks). Tokens the target's vocabulary
    lacks (``vocab_size``) end a draft. ``max_len``: the draft's context."""

    def __init__(
        self, name: str, runner: ModelRunner, vocab_size: int, max_len: int, shared: KVCache | None = None
    ):
        """``shared``: the target's cache, when its first layers are this draft's (self-
        speculation, the same dtype): a request's computed KV is copied from there
        (``_copy_computed``) instead of being run through the draft again."""
        self.name = name
        self.runner = runner
        self.shared = shared
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.block_size = runner.block_size
        self._free = list(range(runner.kv_cache.layout.num_blocks - 1, -1, -1))
        self._seqs: dict[str, _DraftSeq] = {}
        self._calls = 0

    # ---- the proposer protocol ---------------------------------------------
    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """See ``Proposer``. Should the draft's step raise, the batch's requests lose
        their draft state (their next proposal catches up from scratch)."""
        self._calls += 1
        batch = {r.request_id for r in requests}
        active = [i for i, r in enumerate(requests) if self._place(r, batch)]
        try:
            return self._drafts(requests, active)
        except Exception:
            for request_id in batch:
                self._release(request_id)
            raise

    def _drafts(self, requests: list[ProposalRequest], active: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        if not active:
            return drafts
        # step 0: every request's uncomputed tokens, decodes first (one attention batch); with
        # a shared cache only the last token is run (the rest is copied: ``_copy_computed``)
        uncomputed = {
            i: 1
            if self.shared is not None and requests[i].block_table
            else len(requests[i].token_ids) - len(self._seqs[requests[i].request_id].tokens)
            for i in active
        }
        active.sort(key=lambda i: uncomputed[i] != 1)
        inputs = StepInputs([], [], [], [], sum(n == 1 for n in uncomputed.values()), [])
        for i in active:
            r = requests[i]
            seq = self._seqs[r.request_id]
            if self.shared is not None and r.block_table:
                self._copy_computed(seq, r)
            self._add_span(inputs, seq, r.token_ids[len(seq.tokens) :], len(seq.tokens), r.lora_slot)
            seq.tokens = list(r.token_ids)
        picked = self._argmax(inputs)
        for i, token in zip(active, picked):
            drafts[i].append(token)
        # steps 1 .. k-1: one token each, for the requests that want more
        for j in range(1, max(requests[i].k for i in active)):
            active = [i for i in active if requests[i].k > j and drafts[i][-1] < self.vocab_size]
            if not active:
                break
            inputs = StepInputs([], [], [], [], len(active), [])
            for i in active:
                seq = self._seqs[requests[i].request_id]
                self._add_span(inputs, seq, [drafts[i][-1]], len(seq.tokens), requests[i].lora_slot)
                seq.tokens.append(drafts[i][-1])
            for i, token in zip(active, self._argmax(inputs)):
                drafts[i].append(token)
        return [self._within_vocab(d) for d in drafts]

    def forget(self, live: Collection[str]) -> None:
        """Drop the state of every request not in ``live`` (finished, aborted, moved)."""
        for request_id in [rid for rid in self._seqs if rid not in live]:
            self._release(request_id)

    # ---- the draft's cache ---------------------------------------------------
    def _place(self, r: ProposalRequest, batch: set[str]) -> bool:
        """Keep the agreeing prefix of ``r``'s draft state and make room for its
        proposal (its tokens plus k - 1 drafted ones); False where it cannot run."""
        n = len(r.token_ids)
        if n + r.k - 1 > self.max_len:
            return False
        seq = self._seqs.setdefault(r.request_id, _DraftSeq())
        seq.used = self._calls
        keep = min(_common_prefix(seq.tokens, r.token_ids), n - 1)  # at least one token to run
        del seq.tokens[keep:]
        need = -(-(n + r.k - 1) // self.block_size) - len(seq.blocks)
        others = [rid for rid in self._seqs if rid not in batch]
        if need > len(self._free) + sum(len(self._seqs[rid].blocks) for rid in others):
            self._release(r.request_id)  # it cannot fit: nothing is evicted for it
            return False
        for victim in sorted(others, key=lambda rid: self._seqs[rid].used):
            if need <= len(self._free):
                break
            self._release(victim)
        for _ in range(max(need, 0)):
            seq.blocks.append(self._free.pop())
        return True

    def _copy_computed(self, seq: _DraftSeq, r: ProposalRequest) -> None:
        """Catch ``seq`` up to all but ``r``'s last token by copying that KV from the
        target's cache (``r.block_table``), whose first layers computed it from the same
        weights and tokens: no draft compute however far it fell behind."""
        start, end, bs = len(seq.tokens), len(r.token_ids) - 1, self.block_size
        if start < end:
            positions = range(start, end)
            src = [r.block_table[p // bs] * bs + p % bs for p in positions]
            dst = [seq.blocks[p // bs] * bs + p % bs for p in positions]
            layers = self.runner.kv_cache.layout.num_layers
            source = self.shared.tensor[:layers].flatten(2, 3)  # [layers, planes, slots, heads, dim]
            target = self.runner.kv_cache.tensor.flatten(2, 3)
            device = target.device
            rows = source.index_select(2, torch.tensor(src, device=device))
            target.index_copy_(2, torch.tensor(dst, device=device), rows)
        seq.tokens = list(r.token_ids[:end])

    def _release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free.extend(seq.blocks)

    def _add_span(
        self, inputs: StepInputs, seq: _DraftSeq, tokens: list[int], start: int, lora_slot: int | None
    ) -> None:
        """``tokens`` of ``seq`` from position ``start`` as the next rows of ``inputs``,
        under the LoRA adapter in ``lora_slot`` (None: the base's; a draft model that
        has no adapters ignores it)."""
        bs, table = self.block_size, seq.blocks
        end = start + len(tokens)
        if lora_slot is not None:
            inputs.lora_rows.append((len(inputs.input_ids), len(tokens), lora_slot))
        inputs.spans.append(SeqSpan(len(inputs.input_ids), len(tokens), end, table))
        inputs.input_ids.extend(tokens)
        inputs.positions.extend(range(start, end))
        inputs.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        inputs.last_index.append(len(inputs.input_ids) - 1)

    def _argmax(self, inputs: StepInputs) -> list[int]:
        logits = self.runner.forward(inputs)
        return logits.argmax(dim=-1).tolist()

    def _within_vocab(self, draft: list[int]) -> list[int]:
        for j, token in enumerate(draft):
            if token >= self.vocab_size:
                return draft[:j]
        return draft


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class EarlyExit(torch.nn.Module):
    """The target's first ``num_layers`` layers, its final norm and LM head, as a
    model a ``ModelRunner`` runs (over a cache of ``num_layers`` layers)."""

    def __init__(self, target: torch.nn.Module, num_layers: int):
        super().__init__()
        self.target = target
        self.num_layers = num_layers

    def forward(self, input_ids, positions, kv_cache, ctx):
        return self.target(input_ids, positions, kv_cache, ctx, num_layers=self.num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


def draft_blocks(kv_tokens: int, max_num_seqs: int, block_size: int, num_tokens: int) -> int:
    """Blocks of a draft cache: as many tokens as the target's cache holds, plus room
    for each running sequence's drafted tokens."""
    return -(-kv_tokens // block_size) + max_num_seqs * -(-num_tokens // block_size)
