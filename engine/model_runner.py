"""Turns a scheduled step into tensors, runs the model and samples.

Packing order: sequences with one new token (decodes) first, then multi-token
prefill chunks, so the attention backend can treat the decodes as one batch.
Only the last position of sequences that reach their end this step goes through
the LM head (with a speculative draft, every position of it: ``engine.speculative``;
with CUDA graphs a draft's positions are packed as decodes: ``spread_drafts``).

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
from splitserve.engine.lora import LoRAAdapter, LoRAAdapters
from splitserve.engine.model.decoder import DecoderModel
from splitserve.engine.model.deltanet import DeltaSpan
from splitserve.engine.model.llama import StepContext
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.sampler import Sampler, SampleRequest, SampleResult
from splitserve.engine.scheduler import ScheduledSeq
from splitserve.engine.sequence import Sequence
from splitserve.engine.speculative.verify import kept
from splitserve.wire.errors import ModelLoadError
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
    # a hybrid model, per span: the slot its state is read from, the one its next state
    # goes to, and (with prefix caching) the one the state at the last block boundary it
    # crosses goes to, with that boundary's tokens into the span (-1, 0: none)
    state_slots: list[tuple[int, int, int, int]] = field(default_factory=list)
    # rows under a LoRA adapter: (first packed row, rows, the adapter's slot)
    lora_rows: list[tuple[int, int, int]] = field(default_factory=list)
    # layer groups (``KVLayout.grouped``): each sliding group's spans and slots, as
    # ``spans`` and ``slots`` are the full layers' (its tables at the same positions)
    window_spans: list[list[SeqSpan]] = field(default_factory=list)
    window_slots: list[list[int]] = field(default_factory=list)

    def add_windows(self, seq: Sequence, spans: list[SeqSpan], start: int, end: int, block_size: int) -> None:
        """Each sliding group's spans and slots of ``seq``, those ``spans`` (just added for
        the full layers) are with the group's table: its blocks before ``window_start``
        (given back; a window never reaches them) read as its first."""
        if not self.window_spans:
            self.window_spans.extend([] for _ in seq.window_tables)
            self.window_slots.extend([] for _ in seq.window_tables)
        bs, skip = block_size, seq.window_start
        for table, out, slots in zip(seq.window_tables, self.window_spans, self.window_slots, strict=True):
            aligned = [table[0]] * skip + table
            out.extend(SeqSpan(s.q_start, s.q_len, s.ctx_len, aligned) for s in spans)
            slots.extend(aligned[p // bs] * bs + p % bs for p in range(start, end))

    def home(self, span: SeqSpan, blocks_per_rank: int) -> int:
        """The rank of an expert-parallel group holding ``span``'s sequence: the one whose
        share of the group's block ids (``blocks_per_rank`` each) its blocks are in."""
        return span.block_table[0] // blocks_per_rank

    def for_rank(self, rank: int, blocks_per_rank: int, block_size: int) -> StepInputs:
        """What rank ``rank`` of an expert-parallel group runs of this step (attention is
        data-parallel: each rank its own sequences): the spans whose blocks it holds,
        packed anew, with its own block ids; its ``last_index`` / ``prompt_index``
        positions, in this step's order."""
        base = rank * blocks_per_rank
        mine = [i for i, span in enumerate(self.spans) if self.home(span, blocks_per_rank) == rank]
        out = StepInputs([], [], [], [], sum(i < self.num_decodes for i in mine), [])
        out.window_spans.extend([] for _ in self.window_spans)
        out.window_slots.extend([] for _ in self.window_slots)
        moved: dict[int, int] = {}  # this step's packed position -> the rank's
        for i in mine:
            span = self.spans[i]
            q, end = len(out.input_ids), span.q_start + span.q_len
            moved.update((p, q + p - span.q_start) for p in range(span.q_start, end))
            groups = [(span, out.spans, self.slots, out.slots)]
            groups += zip(
                (w[i] for w in self.window_spans), out.window_spans, self.window_slots, out.window_slots
            )
            for s, spans, slots, rank_slots in groups:
                spans.append(SeqSpan(q, s.q_len, s.ctx_len, [b - base for b in s.block_table]))
                rank_slots.extend(x - base * block_size for x in slots[span.q_start : end])
            out.input_ids.extend(self.input_ids[span.q_start : end])
            out.positions.extend(self.positions[span.q_start : end])
        out.last_index.extend(moved[p] for p in self.last_index if p in moved)
        out.prompt_index.extend(moved[p] for p in self.prompt_index if p in moved)
        return out

    def gather_plan(self, blocks_per_rank: int, size: int) -> tuple[list[int], list[int]]:
        """(rows each rank gives, order): every rank's ``for_rank`` rows of
        ``last_index + prompt_index``, concatenated in rank order, taken at ``order``,
        are this step's ``last_index + prompt_index`` rows."""
        owner: dict[int, int] = {}
        for span in self.spans:
            r = self.home(span, blocks_per_rank)
            owner.update((p, r) for p in range(span.q_start, span.q_start + span.q_len))
        wanted = [(0, p) for p in self.last_index] + [(1, p) for p in self.prompt_index]
        by_rank: list[list[tuple[int, int]]] = [[] for _ in range(size)]
        for w in wanted:
            by_rank[owner[w[1]]].append(w)
        at = {w: i for i, w in enumerate(w for rows in by_rank for w in rows)}
        return [len(rows) for rows in by_rank], [at[w] for w in wanted]


@dataclass(frozen=True)
class MTPHead:
    """What the MTP layer predicted for a sequence in the last step: ``token``, to
    follow the sequence once it holds ``num_tokens`` tokens (the one after the next)."""

    token: int
    num_tokens: int


@dataclass(frozen=True)
class TakeExpertLoad:
    """The driver asks every rank for its experts' counts (``take_expert_load``)."""


@dataclass(frozen=True)
class WriteAdapter:
    """Driver to every rank: write this rank's share of LoRA adapter ``name`` from
    ``path`` into ``slot`` (None: check only that it fits; ``LoRAAdapters.write``), then
    report (``gather_object``)."""

    name: str
    path: str
    slot: int | None
    digest: str  # the weights the driver serves under ``name``: a rank reading others refuses


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
        data_parallel: bool = False,
        loras: LoRAAdapters | None = None,
    ):
        """``tp`` is the group the steps go to; with ``data_parallel`` (expert
        parallelism) it is an expert-parallel group whose ranks each run their own
        sequences of a step (``StepInputs.for_rank``) and the driver gathers the rows
        it samples from."""
        self.model = model
        self.loras = loras  # the model's LoRA adapters: each step's rows go to theirs
        self.data_parallel = data_parallel and tp is not None and tp.size > 1
        self.graphs = graphs
        self.kv_cache = kv_cache
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.tp = tp or TPGroup.single()
        self.block_size = kv_cache.layout.block_size
        # a verification chunk [last, d1 .. dk] as k+1 one-token decode spans, row j over
        # the sequence's prefix through it (all rows' KV is written before attention
        # reads, layer by layer): a step with drafts then has the pure-decode shape CUDA
        # graphs replay. Without graphs it stays one chunk (the prefill path reads the
        # sequence's KV once for all its rows, a decode span per row once each).
        self.spread_drafts = graphs is not None
        # a model with its MTP layer: each step's predictions of the token after next, by
        # request id (``_predict_next``), kept when an MTP proposer reads them
        self.keep_mtp_heads = False
        self.mtp_heads: dict[str, MTPHead] = {}
        self.tokens_run = 0  # tokens this rank ran through the model (its own share, data-parallel)

    def execute(
        self, scheduled: list[ScheduledSeq], on_layer: Callable[[int], None] | None = None
    ) -> tuple[list[ScheduledSeq], SampleResult | None, dict[str, list[PromptLogprob]]]:
        """Run one step (driver rank). Returns the scheduled entries in packed order, the
        sampled tokens for those entries whose ``samples`` is true (in the same order),
        and, by request id, the prompt logprobs this step computed for sequences that ask
        for them (the next ones after those they hold). ``on_layer(i)`` is called after
        layer ``i`` wrote its KV (never on a graph replay: those are pure-decode steps)."""
        ordered = sorted(scheduled, key=lambda s: not self._as_decodes(s))
        bs = self.block_size
        decodes = sum(s.num_new_tokens for s in ordered if self._as_decodes(s))
        inputs = StepInputs([], [], [], [], decodes, [])
        rows: list[SampleRequest] = []
        prompt_rows: list[tuple[Sequence, int]] = []  # (sequence, the prompt token scored)
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            first = len(inputs.spans)
            if s.num_new_tokens > 1 and self._as_decodes(s):  # a draft's rows, each over its prefix
                q = len(inputs.input_ids)
                inputs.spans.extend(
                    SeqSpan(q + j, 1, start + j + 1, seq.block_table) for j in range(end - start)
                )
            else:
                inputs.spans.append(SeqSpan(len(inputs.input_ids), s.num_new_tokens, end, seq.block_table))
            if seq.window_tables:
                inputs.add_windows(seq, inputs.spans[first:], start, end, bs)
            if seq.state_slot is not None:
                inputs.state_slots.append(_state_slots(seq, start, end, bs))
            if seq.params.adapter is not None and self.loras is not None:  # no slot: begin_step refuses
                inputs.lora_rows.append((len(inputs.input_ids), s.num_new_tokens, seq.lora_slot))
            inputs.input_ids.extend(s.input_ids)
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
                after = len(inputs.input_ids) - 1 - len(s.draft)
                inputs.last_index.extend(range(after, len(inputs.input_ids)))
                rows.extend(_rows(s))
        if self.model.mtp is not None:
            return self._execute_with_mtp(ordered, inputs, rows, prompt_rows, on_layer)
        graphs = self.graphs
        if (
            on_layer is None
            and not prompt_rows
            and graphs is not None
            and graphs.fits(len(inputs.input_ids), inputs.num_decodes, len(rows))
        ):
            tables = [s.block_table for s in inputs.spans]
            logits = graphs.run(inputs.input_ids, inputs.positions, inputs.slots, tables, inputs.lora_rows)
        else:
            logits = self.run(inputs, on_layer)
        _swap_states(ordered, bs)
        if logits is None:
            return ordered, None, {}
        prompt = _prompt_logprobs(logits[len(rows) :], prompt_rows) if prompt_rows else {}
        return ordered, self.sampler(logits[: len(rows)], rows) if rows else None, prompt

    def _execute_with_mtp(self, ordered, inputs: StepInputs, rows, prompt_rows, on_layer):
        """``execute`` for a model with its MTP layer (a group of one, no graphs): the
        target's step, its sampling, then the MTP layer over the same rows
        (``_predict_next``)."""
        self.tokens_run += len(inputs.input_ids)
        ctx = self._context(inputs, on_layer, False)
        positions = torch.tensor(inputs.positions, dtype=torch.long, device=self.device)
        ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, positions, self.kv_cache, ctx)
        wanted = inputs.last_index + inputs.prompt_index
        logits = self.model.compute_logits(self._rows(hidden, wanted)) if wanted else None
        result = self.sampler(logits[: len(rows)], rows) if rows else None
        prompt = _prompt_logprobs(logits[len(rows) :], prompt_rows) if prompt_rows else {}
        self._predict_next(ordered, inputs, positions, hidden, ctx, result)
        return ordered, result, prompt

    def _predict_next(self, ordered, inputs, positions, hidden, ctx, result: SampleResult | None) -> None:
        """Run the MTP layer over the step's rows, each with the token after it: the next
        row's input inside a chunk, a sampled row's sample (a verification chunk's rows
        each their own), the prompt's next token after a chunk that does not sample. So
        its KV is written wherever the target's was. With ``keep_mtp_heads``, set
        ``mtp_heads``: each sampled sequence's prediction from its last kept row."""
        next_ids = inputs.input_ids[1:] + [0]
        heads: list[tuple[str, int, int]] = []  # (request id, packed row, its tokens after the step)
        row = sample = 0
        for s in ordered:
            last = row + s.num_new_tokens - 1
            if s.samples:
                tokens = result.token_ids[sample : sample + len(s.draft) + 1]
                sample += len(tokens)
                first = last - len(s.draft)
                next_ids[first : last + 1] = [max(t, 0) for t in tokens]  # -1: a failed row
                n = kept([t if t >= 0 else None for t in tokens], s.draft)
                if n:
                    heads.append((s.seq.request_id, first + n - 1, s.seq.num_tokens + n))
            else:
                end = s.seq.num_computed_tokens + s.num_new_tokens
                next_ids[last] = s.seq.token_ids[end] if end < s.seq.num_tokens else 0
            row = last + 1
        ids = torch.tensor(next_ids, dtype=torch.long, device=self.device)
        states = self.model.predict_next(ids, positions, hidden, self.kv_cache, ctx)
        self.mtp_heads = {}
        if heads and self.keep_mtp_heads:
            logits = self.model.compute_logits(self._rows(states, [r for _, r, _ in heads]))
            tokens = logits.argmax(dim=-1).tolist()
            self.mtp_heads = {rid: MTPHead(t, n) for (rid, _, n), t in zip(heads, tokens)}

    def _as_decodes(self, s: ScheduledSeq) -> bool:
        """Whether ``s`` runs as one-token decode spans: a decode, or (``spread_drafts``)
        a verification chunk."""
        return s.num_new_tokens == 1 or (self.spread_drafts and bool(s.draft))

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
        """The model on one step's inputs (this rank's share of them, data-parallel): KV
        written to the cache; the logits of ``last_index`` then ``prompt_index`` (full
        vocabulary, the model's dtype) on the driver, or None when nothing samples (and
        on the other ranks)."""
        if not self.data_parallel:
            self.tokens_run += len(inputs.input_ids)
            hidden = self._run_model(inputs, on_layer, calibrate_kv)
            wanted = inputs.last_index + inputs.prompt_index
            return self.model.compute_logits(self._rows(hidden, wanted)) if wanted else None
        per_rank = self.kv_cache.layout.num_blocks
        mine = inputs.for_rank(self.tp.rank, per_rank, self.block_size)
        self.tokens_run += len(mine.input_ids)
        hidden = self._run_model(mine, on_layer, calibrate_kv)
        counts, order = inputs.gather_plan(per_rank, self.tp.size)
        if not sum(counts):
            return None
        every = self.tp.all_gather_rows(self._rows(hidden, mine.last_index + mine.prompt_index), counts)
        if not self.tp.is_driver:
            return None
        return self.model.compute_logits(every.index_select(0, torch.tensor(order, device=self.device)))

    def _run_model(
        self, inputs: StepInputs, on_layer: Callable[[int], None] | None, calibrate_kv: bool
    ) -> torch.Tensor:
        """Hidden states of every packed position, [T, hidden]."""
        dev = self.device
        ids_t = torch.tensor(inputs.input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(inputs.positions, dtype=torch.long, device=dev)
        if not inputs.spans:  # a data-parallel rank with no sequence in this step
            return self.model(ids_t, pos_t, self.kv_cache, None)
        return self.model(ids_t, pos_t, self.kv_cache, self._context(inputs, on_layer, calibrate_kv))

    def _context(
        self, inputs: StepInputs, on_layer: Callable[[int], None] | None, calibrate_kv: bool
    ) -> StepContext:
        dev = self.device
        if self.loras is not None:
            self.loras.begin_step(inputs.lora_rows, len(inputs.input_ids))
        delta_spans = None
        if inputs.state_slots:  # a hybrid model's linear layers: each span's state, fresh at position 0
            delta_spans = [
                DeltaSpan(sp.q_start, sp.q_len, slot, out, inputs.positions[sp.q_start] == 0, at, mark)
                for sp, (slot, out, mark, at) in zip(inputs.spans, inputs.state_slots, strict=True)
            ]
        groups = [(inputs.slots, inputs.spans), *zip(inputs.window_slots, inputs.window_spans)]
        contexts = [
            StepContext(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                backend=self.backend,
                attn_meta=self.backend.prepare(spans, inputs.num_decodes, self.block_size, dev),
                on_layer=on_layer,
                calibrate_kv=calibrate_kv,
                delta_spans=delta_spans,
            )
            for slots, spans in groups
        ]
        if len(contexts) > 1:  # layer groups: each layer reads its group's (``StepContext.of``)
            contexts[0].groups = contexts
        return contexts[0]

    def _rows(self, hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
        return hidden.index_select(0, torch.tensor(positions, dtype=torch.long, device=self.device))

    def take_expert_load(self) -> list[int]:
        """Driver: rows each routed expert computed since the last call, all MoE layers
        summed, in expert order (under expert parallelism gathered from every rank,
        each counting its own experts)."""
        if self.data_parallel:
            self.tp.broadcast_object(TakeExpertLoad())
            return [n for counts in self.tp.gather_object(self._held_load()) for n in counts]
        return self._held_load()

    def _held_load(self) -> list[int]:
        per_layer = [m.take_routed() for m in self.model.moe_layers()]
        return [sum(c) for c in zip(*per_layer)]

    def write_adapter(self, name: str, path: str, slot: int | None, adapter: LoRAAdapter) -> str:
        """Driver: every rank writes its share of LoRA adapter ``name`` into ``slot`` (no
        row selects it yet; None: checks that it fits), the driver from ``adapter``, the
        others reading ``path`` and refusing other weights than its digest; returns it.
        ``ModelLoadError`` with the first refusal's sentence, naming the rank in a group;
        what the other ranks wrote is garbage in a slot no row selects."""
        order = WriteAdapter(name, path, slot, adapter.digest)
        if self.tp.size > 1:
            self.tp.broadcast_object(order)
        own = self._write_adapter(order, adapter)
        outcomes = self.tp.gather_object(own) if self.tp.size > 1 else [own]
        for rank, outcome in enumerate(outcomes):
            if isinstance(outcome, ModelLoadError):
                where = f"TP rank {rank}: " if self.tp.size > 1 else ""
                raise ModelLoadError(f"{where}{outcome}")
        return own

    def _write_adapter(self, order: WriteAdapter, adapter: LoRAAdapter | None = None) -> str | ModelLoadError:
        """This rank's part of ``write_adapter``: the digest, or why not (never raised: a
        follower that raised would leave its group)."""
        try:
            if self.loras is None:
                raise ModelLoadError("LoRA adapters are not enabled on this engine (enable_lora)")
            return self.loras.write(order.name, order.path, order.slot, adapter, order.digest)
        except ModelLoadError as e:
            return e
        except Exception as e:  # a file that is not what it claims (JSON, safetensors)
            return ModelLoadError(f"LoRA adapter {order.name!r} ({order.path}): {type(e).__name__}: {e}")

    def follow(self, on_message: Callable[[Any], None] | None = None) -> int:
        """Non-driver ranks: run every step the driver broadcasts until it stops us;
        any other message goes to ``on_message``. Returns the number of steps run."""
        steps = 0
        while (msg := self.tp.broadcast_object()) is not None:
            if isinstance(msg, StepInputs):
                self.forward(msg)
                steps += 1
            elif isinstance(msg, TakeExpertLoad):
                self.tp.gather_object(self._held_load())
            elif isinstance(msg, WriteAdapter):
                self.tp.gather_object(self._write_adapter(msg))
            elif on_message is not None:
                on_message(msg)
            else:
                raise RuntimeError(f"TP rank {self.tp.rank} got a {type(msg).__name__} and has no handler")
        return steps

    def stop_followers(self) -> None:
        """Driver: release the other ranks from ``follow()``."""
        if self.tp.is_driver:
            self.tp.broadcast_object(None)


def _state_slots(seq: Sequence, start: int, end: int, block_size: int) -> tuple[int, int, int, int]:
    """A hybrid sequence's slots for a step over its tokens [start, end): the state read
    (its own, or the snapshot its cached prefix starts from), the one written, and the
    mark slot with the tokens into the step of the last block boundary in (start, end]
    (-1 and 0 when it has no mark slot or crosses none)."""
    slot = seq.state_from if seq.state_from is not None else seq.state_slot
    boundary = end // block_size * block_size
    if seq.state_mark is None or boundary <= start:
        return slot, seq.state_spare, -1, 0
    return slot, seq.state_spare, seq.state_mark, boundary - start


def _swap_states(ordered: list[ScheduledSeq], block_size: int) -> None:
    """A step ran whole: each hybrid sequence's state is now the one it wrote (its spare
    slot), and its old one the spare; where it wrote a boundary's state to its mark
    slot, ``state_marked`` says after how many tokens (the engine keeps it as a
    snapshot). Not before: a step that failed runs again from the states it started
    from (``engine.containment``)."""
    for s in ordered:
        seq = s.seq
        if seq.state_slot is not None:
            seq.state_slot, seq.state_spare = seq.state_spare, seq.state_slot
            start = seq.num_computed_tokens
            _, _, mark, at = _state_slots(seq, start, start + s.num_new_tokens, block_size)
            seq.state_marked = start + at if mark >= 0 else None


def _rows(s: ScheduledSeq) -> list[SampleRequest]:
    """What to sample at the end of ``s``: its next token, or with a draft d1..dk one
    row per position, row j as the token after d1..dj would be sampled were they the
    sequence's own (its index, its tokens, its grammar past them: ``speculative.verify``)."""
    seq, draft, n, prompt = s.seq, s.draft, s.seq.num_output_tokens, s.seq.num_prompt_tokens
    rows = [SampleRequest(seq.params, n, seq.token_ids, prompt, seq.grammar)]
    for j in range(1, len(draft) + 1):
        grammar = seq.grammar.fork(draft[:j]) if seq.grammar is not None else None
        rows.append(SampleRequest(seq.params, n + j, seq.token_ids + draft[:j], prompt, grammar))
    return rows


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
