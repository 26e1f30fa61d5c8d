"""Turns a scheduled step into tensors, runs the model and samples.

Packing order: sequences with one new token (decodes) first, then multi-token
prefill chunks, so the attention backend can treat the decodes as one batch.
Only the last position of sequences that reach their end this step goes through
the LM head.
"""

from __future__ import annotations

import torch

from splitserve.engine.attention import AttentionBackend, SeqSpan
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.model.llama import LlamaModel, StepContext
from splitserve.engine.sampler import Sampler, SampleRequest, SampleResult
from splitserve.engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.layout.block_size

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], SampleResult | None]:
        """Run one step. Returns the scheduled entries in packed order and the sampled
        tokens for those entries whose ``samples`` is true (in the same order)."""
        ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        num_decodes = sum(1 for s in ordered if s.num_new_tokens == 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        last_index: list[int] = []
        rows: list[SampleRequest] = []
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            spans.append(SeqSpan(len(input_ids), s.num_new_tokens, end, seq.block_table))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.samples:
                last_index.append(len(input_ids) - 1)
                rows.append(SampleRequest(seq.params, seq.num_output_tokens))
        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        ctx = StepContext(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            backend=self.backend,
            attn_meta=self.backend.prepare(spans, num_decodes, bs, dev),
        )
        hidden = self.model(ids_t, pos_t, self.kv_cache, ctx)
        if not rows:
            return ordered, None
        idx = torch.tensor(last_index, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        return ordered, self.sampler(logits, rows)
