"""Where a request's prompt is prefilled: on a prefill worker, its KV then handed over
(REMOTE), or on the decode worker that will decode it (LOCAL). One decision per
request, made by ``Decider.decide`` from measured figures; each counted.

The cost model, in seconds, for a prompt of ``n`` tokens with decode worker D and
prefill worker P (the balancer's picks)::

    local   = (D's queued prompt tokens  + n - cached on D) / rate
    remote  = (P's queued prompt tokens  + n - cached on P) / rate + handover
    stall   = (n - cached on D) / rate       what a local prefill costs every
                                             sequence D is decoding (one long step)

``rate`` is the workers' measured prompt throughput (``EngineStats.
prefill_tokens_per_s``: D's, which a decode worker measures when it starts, else
P's; they run the same model); ``handover`` is
the measured time from a prefill result to the decode worker holding the KV (a
moving average of this router's own requests; 0 until the first one).

Queued prompt tokens are the router's own count of prompts it sent and that
have not produced their first token yet. LOCAL when ``local`` is within the
budget (below) and the request gains at least what it costs the others::

    remote - local >= stall

or, when D decodes nothing (nobody stalls now), when ``local <= remote``. With
an idle prefill pool and nothing cached this is ``n / rate <= handover``: a
prompt whose prefill takes less than the handover is prefilled in place. A
queued prefill pool, or a prefix D holds, raise the gain.

The budget (``PolicySpec.stall_budget_s``) bounds ``local``: the prompt tokens
waiting at D, this one's included, which D's engine prefills in its next steps
(together, where they fit its step's token budget), so that D's inter-token gap
grows past neither ``local_prefill_max_stall_steps`` of its own decode steps
(``EngineStats.decode_step_s``, as D last reported it; a decode worker measures
one when it starts) nor, when that is set, ``local_prefill_max_stall_ms``. Where
the router has a TPOT target T (``stall_tpot_ms``: the SLO's), the budget is the
slack those steps leave against it instead, ``steps * (T - step)``: the mean time
per token over the steps around a stall keeps T, and a worker whose steps already
take T prefills nothing here. It
also bounds what sequences that arrive at D during the prefill wait, so it
applies when D is idle too, and before the queue comparison: a long prompt goes
to a queued prefill pool rather than hold up D's batch for seconds. Counted in
decode steps, the budget follows the machine: where prefill and decode are both
twice as fast, it admits the same prompts.

The same figures decide whether the chosen prefill worker P copies the prompt's
cached prefix from another prefill worker H that holds more of it (``pull_source``),
rather than compute it::

    compute = (cached on H - cached on P) / rate     (P's rate, else H's)
    copy    = handover

A copy moves a prefix's KV as a handover moves a prompt's (a loan call, then a pull
over the same backend); ``handover`` is the measured cost of one, so a prefix whose
compute time is below it is computed. Not before a rate is measured. H is the worker
holding the most of the prompt.

Fixed rules come first: colocated clusters (no prefill pool) are
LOCAL; ``local_prefill_below_tokens`` is a floor under which a prompt is always
LOCAL; a pool with no routable prefill worker (all lost or restarting) means
LOCAL, whatever the policy, so the cluster keeps serving (``fallback``: the same
when every prefill worker a request tried was lost); with
``conditional_disaggregation`` off, everything else is REMOTE; before any rate
is measured, REMOTE.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

from splitserve.router.balancer import Prompt
from splitserve.router.policy import PolicySpec
from splitserve.router.registry import WorkerRecord


class Placement(enum.Enum):
    REMOTE = "remote"  # prefill worker, then a KV handover
    LOCAL = "local"  # the decode worker prefills it


class Reason(enum.Enum):
    COLOCATED = "colocated"  # every worker does both phases
    NO_PREFILL_WORKER = "no_prefill_worker"
    BELOW_THRESHOLD = "below_threshold"  # under local_prefill_below_tokens
    FIXED_POLICY = "fixed_policy"  # conditional disaggregation off, or no rate measured yet
    DECODE_IDLE = "decode_idle"  # D decodes nothing: the faster place wins
    GAIN = "gain"  # remote - local >= stall: LOCAL
    STALL_CAP = "stall_cap"  # D's waiting prompts and this one would stall its batch past the budget
    NO_GAIN = "no_gain"  # remote - local < stall: REMOTE


@dataclass(frozen=True)
class Decision:
    placement: Placement
    reason: Reason
    local_s: float = 0.0  # the estimates it was made on (0.0 where not computed)
    remote_s: float = 0.0
    stall_s: float = 0.0
    budget_s: float = 0.0  # the stall budget at D


class Decider:
    """Decides placements and keeps the figures they need. Used from the router's loop."""

    def __init__(self, handover_decay: float = 0.8):
        self.handover_s = 0.0  # moving average of measured handovers
        self._handover_decay = handover_decay
        self._handovers = 0
        self.counts: Counter[tuple[Placement, Reason]] = Counter()

    def observe_handover(self, seconds: float) -> None:
        """A request's KV reached its decode worker ``seconds`` after its prefill result."""
        d = self._handover_decay if self._handovers else 0.0
        self.handover_s = d * self.handover_s + (1 - d) * seconds
        self._handovers += 1

    def decide(
        self,
        policy: PolicySpec,
        prompt: Prompt,
        decode: WorkerRecord,
        prefill: WorkerRecord | None,
        colocated: bool = False,
    ) -> Decision:
        """Where ``prompt`` is prefilled, given the balancer's picks (``prefill`` None: no
        routable prefill worker). Reads the records only; counts the decision."""
        decision = self._decide(policy, prompt, decode, prefill, colocated)
        self.counts[decision.placement, decision.reason] += 1
        return decision

    def fallback(self) -> Decision:
        """A REMOTE request's prefill workers were lost and none is left: the decode
        worker prefills it after all (counted)."""
        decision = Decision(Placement.LOCAL, Reason.NO_PREFILL_WORKER)
        self.counts[decision.placement, decision.reason] += 1
        return decision

    def pull_source(
        self, prompt: Prompt, prefill: WorkerRecord, holders: list[WorkerRecord]
    ) -> WorkerRecord | None:
        """The worker among ``holders`` that ``prefill`` should copy ``prompt``'s cached
        prefix from (the one holding the most of it, where copying the tokens it has
        beyond ``prefill``'s beats computing them), or None. Reads the records only."""
        if not holders:
            return None
        holder = max(holders, key=prompt.cached_on)
        rate = prefill.prefill_tokens_per_s or holder.prefill_tokens_per_s  # the same model
        extra = prompt.cached_on(holder) - prompt.cached_on(prefill)
        if rate <= 0 or extra <= 0 or extra / rate <= self.handover_s:
            return None
        return holder

    def _decide(
        self,
        policy: PolicySpec,
        prompt: Prompt,
        decode: WorkerRecord,
        prefill: WorkerRecord | None,
        colocated: bool,
    ) -> Decision:
        if colocated:
            return Decision(Placement.LOCAL, Reason.COLOCATED)
        uncached_local = prompt.num_tokens - prompt.cached_on(decode)
        if uncached_local < policy.local_prefill_below_tokens:
            return Decision(Placement.LOCAL, Reason.BELOW_THRESHOLD)
        if prefill is None:
            return Decision(Placement.LOCAL, Reason.NO_PREFILL_WORKER)
        if not policy.conditional_disaggregation:
            return Decision(Placement.REMOTE, Reason.FIXED_POLICY)
        rate = decode.prefill_tokens_per_s or prefill.prefill_tokens_per_s
        if rate <= 0:
            return Decision(Placement.REMOTE, Reason.FIXED_POLICY)
        local = (decode.queued_prompt_tokens + uncached_local) / rate
        remote = (prefill.queued_prompt_tokens + prompt.num_tokens - prompt.cached_on(prefill)) / rate
        remote += self.handover_s
        stall = uncached_local / rate
        budget = policy.stall_budget_s(decode.decode_step_s)
        figures = (local, remote, stall, budget)
        if local > budget:
            return Decision(Placement.REMOTE, Reason.STALL_CAP, *figures)
        if decode.running == 0:
            placement = Placement.LOCAL if local <= remote else Placement.REMOTE
            return Decision(placement, Reason.DECODE_IDLE, *figures)
        if remote - local >= stall:
            return Decision(Placement.LOCAL, Reason.GAIN, *figures)
        return Decision(Placement.REMOTE, Reason.NO_GAIN, *figures)
