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
from splitserve.wire.config import SpeculativeConfig
from splitserve.wire.outputs import SpeculationCounters

log = logging.getLogger(__name__)

# a verified draft token's cost (its row of the target's step), as a fraction of a
# decode step: a request proposes the j-th token only while its acceptance rate a has
# a^j >= this plus the proposer's own cost per token (``cost``; ``adaptive``)
MIN_GAIN = 0.3
COST_DECAY = 0.9  # weight of earlier timings in the proposer's measured cost


class Speculation:
    def __init__(self, config: SpeculativeConfig, target: Target):
        self.config = config
        self.proposer = build_proposer(config, target)
        self.max_model_len = target.max_model_len
        self.proposed = self.accepted = self.steps = 0  # tokens; sequence-steps checked
        self.proposer_errors = 0
        # decayed seconds: the proposer per draft position, the engine per step
        self._propose_s = self._step_s = 0.0

    @property
    def cost(self) -> float:
        """The proposer's time for one more draft position, as a fraction of an engine
        step (measured: ~0 for a lookup, the draft's step over the target's for a model)."""
        return self._propose_s / self._step_s if self._step_s else 0.0

    def stepped(self, seconds: float) -> None:
        """The engine ran a step (its model part) in ``seconds``."""
        self._step_s = COST_DECAY * self._step_s + (1 - COST_DECAY) * seconds if self._step_s else seconds

    def drafts(self, running: Iterable[Sequence], states: dict[str, RequestState]) -> dict[str, list[int]]:
        """Tokens proposed for the decoding sequences of ``running`` that speculate, by
        request id: each as many as its acceptance asks for (``adaptive``), no more
        than it may still generate, cut where its grammar would refuse one."""
        self.proposer.forget(states.keys())
        wanted: list[ProposalRequest] = []
        for seq in running:
            if seq.num_uncomputed_tokens != 1 or seq.prefill_only or not seq.params.speculate:
                continue
            state = states[seq.request_id]
            if state.acceptance is None:
                state.acceptance = Acceptance(self.config.num_tokens)
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            k = min(state.acceptance.k(MIN_GAIN + self.cost), room)
            if k > 0 and not (seq.grammar is not None and seq.grammar.done):
                wanted.append(ProposalRequest(seq.request_id, seq.token_ids, k))
        if not wanted:
            return {}
        started = time.perf_counter()
        try:
            proposals = self.proposer.propose(wanted)
        except Exception as e:  # a proposer's fault costs this step's proposals only
            self.proposer_errors += 1
            log.warning("the %s proposer failed (%r); this step runs without drafts", self.proposer.name, e)
            return {}
        per_position = (time.perf_counter() - started) / max(r.k for r in wanted)
        self._propose_s = (
            COST_DECAY * self._propose_s + (1 - COST_DECAY) * per_position
            if self._propose_s
            else per_position
        )
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
