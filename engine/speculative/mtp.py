"""The MTP proposer: DeepSeek-V3's (or GLM-4.5's) multi-token prediction layer as the draft.

The layer runs inside the target's own steps (``ModelRunner._predict_next``): after
a step samples, it reads the target's last hidden states and the tokens after them,
writes its KV (a layer of the target's cache) and predicts each sequence's token
after next. That prediction is this step's draft: proposing costs nothing more.

- one token per step: the checkpoint has one MTP layer, and chaining it deeper would
  write KV past the blocks a sequence holds before it is scheduled (not built);
- a sequence that did not run in the last step (just handed over, preempted,
  resumed) proposes nothing this step; its next step runs the layer again;
- through a handoff, the prompt's MTP KV comes with the target's from the prefill
  worker, which runs the layer too (``EngineConfig.mtp_layer``): a layer of the KV.
"""

from __future__ import annotations

from collections.abc import Collection

from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.speculative import ProposalRequest


class MTPProposer:
    name = "mtp"

    def __init__(self, runner: ModelRunner):
        """``runner``: the target's, built with its MTP layer; it keeps its predictions
        for this proposer from now on (``keep_mtp_heads``)."""
        self.runner = runner
        runner.keep_mtp_heads = True

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        heads = self.runner.mtp_heads
        out = []
        for r in requests:
            head = heads.get(r.request_id)
            out.append([head.token] if head is not None and head.num_tokens == len(r.token_ids) else [])
        return out

    def forget(self, live: Collection[str]) -> None:
        """Nothing to drop: the runner keeps the last step's predictions only."""
