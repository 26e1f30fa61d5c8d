"""The router's admission limits and routing policy, as the serving config states
them: these pydantic models are the only definition of their fields and
defaults (``cluster.config`` nests them; the dispatcher reads them as they are)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from splitserve.router.step_time import StepTimes


class StrictModel(BaseModel):
    """A config section: unknown fields are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsSpec(StrictModel):
    max_inflight_requests: int = Field(
        512, ge=1, description="requests admitted and unfinished; past it: RESOURCE_EXHAUSTED"
    )
    max_queued_prompt_tokens: int = Field(
        32768, ge=1, description="prompt tokens waiting per prefill worker; past it: RESOURCE_EXHAUSTED"
    )
    max_admission_queue: int = Field(
        256,
        ge=1,
        description="prefilled requests waiting for KV blocks per decode worker (served in arrival order); "
        "past it: RESOURCE_EXHAUSTED",
    )
    max_decode_batch: int | None = Field(
        None,
        ge=1,
        description="requests each decode worker is given at once at most, from the moment it is picked "
        "(while the prompt is prefilled elsewhere too) until the request ends; when every decode worker has "
        "that many, a new request gets RESOURCE_EXHAUSTED at once. Set it to the batch whose step time meets "
        "your TPOT: admitted requests then keep that TPOT however high the load (null: no cap; KV blocks and "
        "max_num_seqs queue the rest inside the worker, so TPOT rises with overload)",
    )
    decode_tpot_ms: float | None = Field(
        None,
        gt=0,
        description="admission by TPOT: each decode worker is given at most the batch whose decode step, on "
        "the line fitted to the step times it reports, takes this long (at least one request; a worker not "
        "yet measured is not capped); when every decode worker has its batch, a new request gets "
        "RESOURCE_EXHAUSTED at once. Admitted requests then keep about this TPOT however high the load "
        "(null: no such cap). Counted like max_decode_batch, and both apply when both are set",
    )
    max_timeout_s: float | None = Field(None, gt=0, description="cap on any request's duration")

    def batch_cap(self, steps: StepTimes) -> int | None:
        """The most requests a decode worker with these step times may be given at once
        (None: no cap)."""
        caps = [self.max_decode_batch]
        if self.decode_tpot_ms is not None:
            caps.append(steps.largest_batch(self.decode_tpot_ms / 1000))
        known = [c for c in caps if c is not None]
        return min(known) if known else None

    def batch_limits(self) -> str:
        """The limits that cap decode batches, as a sentence's clause."""
        said = []
        if self.max_decode_batch is not None:
            said.append(f"limits.max_decode_batch {self.max_decode_batch}")
        if self.decode_tpot_ms is not None:
            said.append(f"limits.decode_tpot_ms {self.decode_tpot_ms:g}")
        return ", ".join(said)


class PolicySpec(StrictModel):
    """How the router places work (``router.decider`` and ``router.balancer`` say how
    each field is used)."""

    conditional_disaggregation: bool = Field(
        True,
        description="decide per request whether the decode worker prefills the prompt itself, from "
        "measured prefill rate, handover time, queues and cached prefixes (router.decider); "
        "false: every prompt goes to a prefill worker unless under local_prefill_below_tokens",
    )
    local_prefill_max_stall_steps: float = Field(
        8.0,
        ge=0,
        description="the longest the prefills waiting on a decode worker (a new one's included) may hold up "
        "the sequences it is decoding, in that worker's own decode steps (its recent mean step time, as it "
        "reports it; the prefills' length is estimated from the measured prompt rate): one inter-token gap "
        "grows to at most about this many plus one. Past it the prompt goes to a prefill worker. In steps, "
        "so the budget follows the hardware and the model (a faster machine decodes and prefills faster "
        "alike); a decode worker that has not reported a step time yet prefills nothing past "
        "local_prefill_below_tokens",
    )
    local_prefill_max_stall_ms: float | None = Field(
        None,
        ge=0,
        description="a fixed budget in milliseconds instead of local_prefill_max_stall_steps "
        "(null: the budget in steps applies)",
    )
    stall_tpot_ms: float | None = Field(
        None,
        gt=0,
        description="the TPOT target a prefill on a decode worker is budgeted against: over the "
        "local_prefill_max_stall_steps steps around one such stall, the mean time per token stays within it, "
        "so the budget is those steps times the slack between this target and the worker's decode step "
        "(none when its steps already take the target). Null: the TPOT target this router is given (the SLO "
        "planner's planner.tpot_ms, else limits.decode_tpot_ms), if any; with none, the budget is "
        "local_prefill_max_stall_steps decode steps. local_prefill_max_stall_ms, when set, overrides both",
    )
    local_prefill_below_tokens: int = Field(
        0,
        ge=0,
        description="prompts with fewer uncached tokens than this are always prefilled on the decode "
        "worker (0: no such floor)",
    )
    prefix_affinity: bool = Field(
        False,
        description="send prompts with the same first block to one prefill worker even before any "
        "worker reports it cached (workers that report a cached prefix are preferred anyway)",
    )

    prefix_pulls: bool = Field(
        True,
        description="a prefill worker copies a prompt's cached prefix from another prefill worker that holds "
        "more of it (over the KV transfer backend, verified) when the decider's cost model says copying "
        "beats computing (router.decider); a pull that fails is computed instead",
    )

    decode_prefix_pulls: bool = Field(
        True,
        description="with prefix_pulls, a prefill worker may also copy a prompt's prefix from a decode "
        "worker's cache (a conversation's earlier turns end there); false: from other prefill workers only",
    )

    def stall_budget_s(self, decode_step_s: float) -> float:
        """The longest, in seconds, the prefills waiting on a decode worker (a new one's
        included) may hold up its batch, for a worker whose recent decode step took
        ``decode_step_s`` (0.0: not measured yet, so no budget unless a fixed one is set).

        With a TPOT target T (``stall_tpot_ms``) and W = ``local_prefill_max_stall_steps``:
        W steps and one stall of ``b`` take at most W * T, so ``b = W * (T - step)``;
        without one, ``W * step`` (as if T were two steps)."""
        if self.local_prefill_max_stall_ms is not None:
            return self.local_prefill_max_stall_ms / 1000
        if not decode_step_s:
            return 0.0
        if self.stall_tpot_ms is not None:
            return self.local_prefill_max_stall_steps * max(0.0, self.stall_tpot_ms / 1000 - decode_step_s)
        return self.local_prefill_max_stall_steps * decode_step_s
