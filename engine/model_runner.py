"""Turns a scheduled step into tensors, runs the model and samples.

Packing order: sequences with one new token (decodes) first, then multi-token
prefill chunks, so the attention backend can treat the decodes as one batch.
Only the last position of sequences that reach their end this step goes through
the LM head.

Under tensor parallelism the driver rank (0) schedules, packs the step into a
``StepInputs`` (plain lists), broadcasts it, and every rank runs the same
forward (the collectives inside the model pair up); only the driver samples.
The other ranks sit in ``follow()`` until the driver calls ``stop_followers()``;
the driver may broadcast its own messages on the same channel (e.g. a worker's
"export your KV shard"), which ``follow`` hands to a callback, in order with
the steps.

With ``graphs`` (TP=1 only), pure-decode steps replay a recorded forward
(``splitserve.engine.cuda_graphs``) instead of launching it kernel by kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve.engine.attention import AttentionBackend, SeqSpan
from splitserve.engine.cuda_graphs import DecodeGraphs
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.model.decoder import DecoderModel
from splitserve.engine.model.llama import StepContext
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.sampler import Sampler, SampleRequest, SampleResult
from splitserve.engine.scheduler import ScheduledSeq
from splitserve.engine.sequence import Sequence
from splitserve.wire.outputs import PromptLogprob


@dataclass(frozen=True)
class StepInputs:
    """One step's model inputs, as plain data (what the driver broadcasts)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    spans: list[SeqSpan]
    num_decodes: int
    last_index: list[int]  # packed positions whose logits are sampled
    # packed positions whose logits give prompt logprobs (after last_index in the logits)
    prompt_index: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
        tp: TPGroup | None = None,
        graphs: DecodeGraphs | None = None,
    ):
        self.model = model
        self.graphs = graphs
        self.kv_cache = kv_cache
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.tp = tp or TPGroup.single()
        self.block_size = kv_cache.layout.block_size

    def execute(
        self, scheduled: list[ScheduledSeq], on_layer: Callable[[int], None] | None = None
    ) -> tuple[list[ScheduledSeq], SampleResult | None, dict[str, list[PromptLogprob]]]:
        """Run one step (driver rank). Returns the scheduled entries in packed order, the
        sampled tokens for those entries whose ``samples`` is true (in the same order),
        and, by request id, the prompt logprobs this step computed for sequences that ask
        for them (the next ones after those they hold). ``on_layer(i)`` is called after
        layer ``i`` wrote its KV (never on a graph replay: those are pure-decode steps)."""
        ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        bs = self.block_size
        inputs = StepInputs([], [], [], [], sum(1 for s in ordered if s.num_new_tokens == 1), [])
        rows: list[SampleRequest] = []
        prompt_rows: list[tuple[Sequence, int]] = []  # (sequence, the prompt token scored)
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            inputs.spans.append(SeqSpan(len(inputs.input_ids), s.num_new_tokens, end, seq.block_table))
            inputs.input_ids.extend(seq.token_ids[start:end])
            inputs.positions.extend(range(start, end))
            table = seq.block_table
            inputs.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if seq.params.prompt_logprobs is not None:
                # position p's logits score prompt token p + 1; skip those already held
                base = len(inputs.input_ids) - s.num_new_tokens - start
                for p in range(max(start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1)):
                    inputs.prompt_index.append(base + p)
                    prompt_rows.append((seq, p + 1))
            if s.samples:
                inputs.last_index.append(len(inputs.input_ids) - 1)
                rows.append(
                    SampleRequest(
                        seq.params, seq.num_output_tokens, seq.token_ids, seq.num_prompt_tokens, seq.grammar
                    )
                )
        graphs = self.graphs
        if (
            on_layer is None
            and not prompt_rows
            and graphs is not None
            and graphs.fits(len(inputs.input_ids), inputs.num_decodes, len(rows))
        ):
            tables = [s.block_table for s in inputs.spans]
            logits = graphs.run(inputs.input_ids, inputs.positions, inputs.slots, tables)
        else:
            logits = self.run(inputs, on_layer)
        if logits is None:
            return ordered, None, {}
        prompt = _prompt_logprobs(logits[len(rows) :], prompt_rows) if prompt_rows else {}
        return ordered, self.sampler(logits[: len(rows)], rows) if rows else None, prompt

    def calibrate_kv(self, token_ids: list[int]) -> None:
        """Every rank, in the same order (the model's collectives run): prefill
        ``token_ids`` into the cache's first blocks, setting an FP8 cache's scales from
        their K and V (``engine.kv_quant``). What it writes is garbage to everyone else:
        call before any request."""
        bs, n = self.block_size, len(token_ids)
        inputs = StepInputs(list(token_ids), list(range(n)), list(range(n)), [], 0, [])
        inputs.spans.append(SeqSpan(0, n, n, list(range(-(-n // bs)))))
        self.forward(inputs, calibrate_kv=True)

    def run(self, inputs: StepInputs, on_layer: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """Driver: send ``inputs`` to the other TP ranks and run the step with them."""
        self.tp.broadcast_object(inputs)
        return self.forward(inputs, on_layer)

    def forward(
        self, inputs: StepInputs, on_layer: Callable[[int], None] | None = None, calibrate_kv: bool = False
    ) -> torch.Tensor | None:
        """The model on one step's inputs: KV written to the cache; the logits of
        ``last_index`` (full vocabulary, the model's dtype), or None when nothing samples."""
        dev = self.device
        ids_t = torch.tensor(inputs.input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(inputs.positions, dtype=torch.long, device=dev)
        ctx = StepContext(
            slot_mapping=torch.tensor(inputs.slots, dtype=torch.long, device=dev),
            backend=self.backend,
            attn_meta=self.backend.prepare(inputs.spans, inputs.num_decodes, self.block_size, dev),
            on_layer=on_layer,
            calibrate_kv=calibrate_kv,
        )
        hidden = self.model(ids_t, pos_t, self.kv_cache, ctx)
        wanted = inputs.last_index + inputs.prompt_index
        if not wanted:
            return None
        idx = torch.tensor(wanted, dtype=torch.long, device=dev)
        return self.model.compute_logits(hidden.index_select(0, idx))

    def follow(self, on_message: Callable[[Any], None] | None = None) -> int:
        """Non-driver ranks: run every step the driver broadcasts until it stops us;
        any other message goes to ``on_message``. Returns the number of steps run."""
        steps = 0
        while (msg := self.tp.broadcast_object()) is not None:
            if isinstance(msg, StepInputs):
                self.forward(msg)
                steps += 1
            elif on_message is not None:
                on_message(msg)
            else:
                raise RuntimeError(f"TP rank {self.tp.rank} got a {type(msg).__name__} and has no handler")
        return steps

    def stop_followers(self) -> None:
        """Driver: release the other ranks from ``follow()``."""
        if self.tp.is_driver:
            self.tp.broadcast_object(None)


def _prompt_logprobs(
    logits: torch.Tensor, rows: list[tuple[Sequence, int]]
) -> dict[str, list[PromptLogprob]]:
    """Each row's prompt token's logprob under the raw distribution, and the most likely
    ones' (as many as its sequence asks), grouped by request id in prompt order."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([seq.token_ids[i] for seq, i in rows], device=lp.device)
    chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
    n = max(seq.params.prompt_logprobs for seq, _ in rows)
    best = lp.topk(n, dim=-1) if n else None
    out: dict[str, list[PromptLogprob]] = {}
    for j, ((seq, _), value) in enumerate(zip(rows, chosen)):
        k = seq.params.prompt_logprobs
        top = tuple(zip(best.indices[j, :k].tolist(), best.values[j, :k].tolist())) if k else ()
        out.setdefault(seq.request_id, []).append((value, top))
    return out
