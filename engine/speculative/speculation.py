"""An engine's speculative decoding: which requests propose how many tokens each
step, and the counts ``EngineStats`` reports. Owned by the ``Engine``, on its thread.

The engine calls ``drafts`` before scheduling a step and ``verified`` for each
sequence whose draft the step checked. A proposer that raises costs its step's
proposals, never a request: speculation only ever changes how fast tokens come.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from splitserve.engine.request_state import RequestState
from splitserve.engine.sequence import Sequence
from splitserve.engine.speculative import ProposalRequest
from splitserve.engine.speculative.adaptive import Acceptance
from splitserve.engine.speculative.build import Target, build_proposer
from splitserve.engine.speculative.cost import StepCost
from splitserve.wire.config import SpeculativeConfig
from splitserve.wire.outputs import SpeculationCounters

log = logging.getLogger(__name__)


class Speculation:
    def __init__(self, config: SpeculativeConfig, target: Target):
        self.config = config
        self.proposer = build_proposer(config, target)
        self.max_model_len = target.max_model_len
        self.proposed = self.accepted = self.steps = 0  # tokens; sequence-steps checked
        self.proposer_errors = 0
        self.cost = StepCost()  # what a draft token costs, measured (``cost``)

    def stepped(self, seconds: float, rows: int, sequences: int) -> None:
        """The engine ran a decode step (its model part) of ``sequences`` sequences and
        ``rows`` query rows in ``seconds``."""
        self.cost.stepped(seconds, rows, sequences)

    def drafts(self, running: Iterable[Sequence], states: dict[str, RequestState]) -> dict[str, list[int]]:
        """Tokens proposed for the decoding sequences of ``running`` that speculate, by
        request id: each as many as its acceptance asks for (``adaptive``; with the
        config's ``adaptive`` off, ``num_tokens``), no more than it may still generate,
        cut where its grammar would refuse one."""
        self.proposer.forget(states.keys())
        min_gain = self.cost.min_gain
        wanted: list[ProposalRequest] = []
        for seq in running:
            if seq.num_uncomputed_tokens != 1 or seq.prefill_only or not seq.params.speculate:
                continue
            state = states[seq.request_id]
            if state.acceptance is None:
                state.acceptance = Acceptance(self.config.num_tokens)
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            k = min(state.acceptance.k(min_gain) if self.config.adaptive else self.config.num_tokens, room)
            if k > 0 and not (seq.grammar is not None and seq.grammar.done):
                wanted.append(
                    ProposalRequest(seq.request_id, seq.token_ids, k, seq.block_table, seq.lora_slot)
                )
        if not wanted:
            return {}
        started = time.perf_counter()
        try:
            proposals = self.proposer.propose(wanted)
        except Exception as e:  # a proposer's fault costs this step's proposals only
            self.proposer_errors += 1
            log.warning("the %s proposer failed (%r); this step runs without drafts", self.proposer.name, e)
            return {}
        self.cost.proposed((time.perf_counter() - started) / max(r.k for r in wanted))
        drafts = {}
        for req, draft in zip(wanted, proposals):
            grammar = states[req.request_id].seq.grammar
            draft = list(draft[: req.k])
            if grammar is not None:
                draft = draft[: grammar.valid_prefix(draft)]
            if draft:
                drafts[req.request_id] = draft
        return drafts

    def verified(self, state: RequestState, proposed: int, accepted: int) -> None:
        """A step checked ``proposed`` tokens of ``state``'s draft and kept ``accepted``."""
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        if state.acceptance is not None:
            state.acceptance.record(proposed, accepted)

    def counters(self) -> SpeculationCounters:
        return SpeculationCounters(
            self.proposer.name, self.proposed, self.accepted, self.steps, self.proposer_errors
        )
