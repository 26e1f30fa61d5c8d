"""Step scheduler: which sequences run in the next model step, and how many of
their tokens. No torch.

Each step has a token budget (``max_num_batched_tokens``). Running sequences go
first, oldest first: a decoding sequence takes one token, a sequence still in
prefill takes as much of its remaining prompt as the budget allows (chunked
prefill), so decodes keep flowing while a long prompt is prefilled over several
steps. Waiting sequences are then admitted first-come-first-served while the
budget, ``max_num_seqs`` and free blocks allow. Admission reuses prefix-cached
blocks when the block manager has them, and the blocks right after them that its
host tier holds are loaded from there (``BlockManager.reload``) before the step.

When a running sequence needs a block and none is free, the newest running
sequence (of its shard, when the block manager is sharded) is preempted: its
blocks are freed and it returns to the front of the waiting queue, to be
recomputed later (its generated tokens are kept and recomputed as part of its
prefix). The engine never crashes for lack of blocks;
no new sequence is admitted in a step that preempted. A waiting sequence that is not
``ready`` (its LoRA adapter waits for a slot) keeps its place; those behind it go first.

Speculative decoding: ``schedule(drafts)`` takes tokens proposed for decoding
sequences (by request id). Such a sequence runs its last token and its draft in
one chunk, as far as the budget and free blocks allow; a draft is shortened or
dropped rather than preempt anything for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """A sequence's share of a step: its next ``num_new_tokens`` tokens, the last
    ``len(draft)`` of which are proposed tokens (speculative decoding) that follow its
    own: they are checked by this step, not yet the sequence's."""

    seq: Sequence
    num_new_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token (so a token is sampled;
        with a draft, one per draft token more)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + len(self.draft)

    @property
    def input_ids(self) -> list[int]:
        """The tokens this chunk runs through the model."""
        seq, start = self.seq, self.seq.num_computed_tokens
        return seq.token_ids[start : start + self.num_new_tokens - len(self.draft)] + self.draft


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that can never fit in the cache; the engine finishes them.
    unschedulable: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start: sequences sent back to waiting for lack of blocks
        # whether a waiting sequence may run now (its LoRA adapter has a slot: the engine's
        # ``bind_lora``); one that may not keeps its place, and those behind it go first
        self.ready: Callable[[Sequence], bool] | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose blocks are already allocated and filled (KV import)."""
        seq.status = SequenceStatus.RUNNING
        seq.mark_scheduled()
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues (finish or abort); the caller frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """The next step. ``drafts``: proposed tokens for decoding sequences, by request
        id (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        drafts = drafts or {}

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            draft = self._fitting_draft(seq, drafts.get(seq.request_id), budget)
            if draft:
                bm.allocate(seq, 1 + len(draft))
                out.scheduled.append(ScheduledSeq(seq, 1 + len(draft), draft))
                budget -= 1 + len(draft)
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, n):
                victim = self._victim(seq)
                if victim is seq and bm.blocks_needed(seq.num_computed_tokens + n) > bm.shard_blocks:
                    out.unschedulable.append(seq)  # larger than the whole cache
                    break
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            # seq was preempted or dropped; the element at i is now a different one.

        if out.preempted:
            return out
        skipped: list[Sequence] = []  # not ready: they keep their place at the front
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.ready is not None and not self.ready(seq):
                skipped.append(self.waiting.popleft())
                continue
            cached = bm.find_cached_prefix(seq) if not seq.block_table else []
            tiered = bm.tier_prefix(seq, cached) if not seq.block_table else 0
            n = min(seq.num_uncomputed_tokens - (len(cached) + tiered) * bm.block_size, budget)
            if cached and bm.shards > 1 and not bm.can_allocate(seq, n, cached):
                cached = []  # its prefix's shard is full: compute it again in another
                n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_allocate(seq, n + tiered * bm.block_size, cached):
                if bm.blocks_needed(seq.num_tokens) > bm.shard_blocks:
                    self.waiting.popleft()
                    out.unschedulable.append(seq)  # larger than the whole cache
                    continue
                break
            self.waiting.popleft()
            if cached:
                bm.take_cached_prefix(seq, cached)
            if tiered:
                missed = tiered - bm.reload(seq, tiered)  # those blocks are computed instead
                n = min(seq.num_uncomputed_tokens, n + missed * bm.block_size, budget)
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            seq.mark_scheduled()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return out

    def _fitting_draft(self, seq: Sequence, draft: list[int] | None, budget: int) -> list[int]:
        """As much of ``draft`` as ``seq`` (decoding) can run this step within ``budget``
        and the free blocks; [] for none (the sequence then runs as any other)."""
        if not draft or seq.num_uncomputed_tokens != 1:
            return []
        draft = draft[: budget - 1]
        while draft and not self.block_manager.can_allocate(seq, 1 + len(draft)):
            draft = draft[:-1]
        return draft

    def _victim(self, seq: Sequence) -> Sequence:
        """The newest running sequence whose blocks are in ``seq``'s shard (``seq`` at the
        latest: the running list holds it), taken out of the running list."""
        bm = self.block_manager
        home = bm.home(seq)
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i] is seq or bm.home(self.running[i]) == home:
                return self.running.pop(i)
        raise AssertionError("a running sequence is missing from the running list")

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
