"""Sequence state: the bookkeeping unit the scheduler and block manager share.

No torch here. A sequence's lifecycle::

    WAITING --schedule--> RUNNING --(eos/stop/length)--> FINISHED
       ^                    |   \\--(prefill_only: first token)--> PREFILLED
       +----preempt---------+                                        |
                                            release() frees blocks --+--> FINISHED

    IMPORTING --activate()--> RUNNING    (decode side: KV arrived from elsewhere)

``num_computed_tokens`` counts tokens whose KV is already in the cache; tokens
``[num_computed_tokens:]`` of ``token_ids`` still have to go through the model.
A sequence is *in prefill* while more than one token is uncomputed and *in decode*
when exactly its last token is.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.wire.outputs import PromptLogprob, TopLogprobs
from splitserve.wire.sampling import FinishReason, SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.structured import Grammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill-only request done; blocks held until release()
    IMPORTING = "importing"  # blocks allocated for incoming KV; scheduled after activate()
    FINISHED = "finished"


_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request as the engine tracks it. Mutated only by the engine's thread."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    # prefill-only: the reader of its KV holds the prompt's first this many full blocks;
    # only the blocks after them are exported
    export_from_block: int = 0

    def __post_init__(self) -> None:
        self.seq_no = next(_counter)  # arrival order, used for FCFS and preemption
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # a grouped layout (``KVLayout.grouped``): each sliding layer group's blocks, those
        # of positions ``window_start`` on (the older ones out of every window were freed);
        # ``block_table`` is the full layers' (``BlockManager``)
        self.window_tables: list[list[int]] = []
        self.window_start = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs] = []
        self.prompt_logprobs: list[PromptLogprob] = []  # prompt tokens 1.., as computed (when asked)
        # structured output: the grammar, advanced by every token appended (set by the engine)
        self.grammar: Grammar | None = None
        self.num_preemptions = 0
        # IMPORTING with KV held or copied ahead (hold_prefix, reserve_moving): the
        # request's import (import_request) is still to come
        self.awaiting_import = False
        # the first block whose sliding layers' KV this engine does not hold (imported
        # without the keys out of their windows: KVLayout.window_from); None: every block
        # whole. The prefix cache registers no block from there on; freeing the blocks
        # (preemption: recomputed whole) resets it
        self.partial_from: int | None = None
        # a hybrid model: the rows of the linear layers' states this sequence holds while it
        # holds blocks (``BlockManager``): its state now, and the one a step writes its next
        # state to (they swap once the step succeeded: ``ModelRunner``); None otherwise
        self.state_slot: int | None = None
        self.state_spare: int | None = None
        # with prefix caching, where a step writes the state at the last block boundary it
        # crosses (``state_marked``: after how many tokens), and the snapshot its first step
        # reads instead of its own slot (a cached prefix taken: ``engine.state_slots``)
        self.state_mark: int | None = None
        self.state_marked: int | None = None
        self.state_from: int | None = None
        self.scheduled_at: float | None = None  # time.time() when first scheduled (or imported)
        # under a LoRA adapter (``params.adapter``; set by the engine as it makes the
        # sequence): the slot its rows select, the adapter's digest, and the parent of its
        # first block's hash (``wire.prefix.prefix_root`` of the digest: no other adapter's
        # KV, nor the base's, is ever taken from the prefix cache for it)
        self.lora_slot: int | None = None
        self.lora_digest = ""
        self.hash_root: int | None = None

    def mark_scheduled(self) -> None:
        """The engine takes this sequence into its running batch (the first time counts)."""
        if self.scheduled_at is None:
            self.scheduled_at = time.time()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(
        self, token_id: int, logprob: float | None = None, top: TopLogprobs | None = None
    ) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.consume(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
