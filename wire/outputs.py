"""What the engine hands back: per-step deltas, whole completions, and the
prefill half's description of the KV it holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.wire.errors import SequenceFailed
from splitserve.wire.sampling import FinishReason

TopLogprobs = tuple[tuple[int, float], ...]  # one step's most likely (token id, logprob), best first
# a prompt token's logprob given the tokens before it, and that position's most likely
PromptLogprob = tuple[float, TopLogprobs]


@dataclass(frozen=True)
class SpeculationCounters:
    """An engine's speculative decoding since it started (``engine.speculative``):
    tokens its proposer suggested, those the target kept, the sequence-steps that
    checked a draft."""

    method: str = ""  # the proposer ("" for none)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verified_steps: int = 0
    proposer_errors: int = 0  # steps whose proposals were lost to a proposer's failure

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a checked sequence-step produced on average (its kept draft tokens and
        the target's own one)."""
        return 1 + self.accepted_tokens / self.verified_steps if self.verified_steps else 0.0


@dataclass(frozen=True)
class TextStart:
    """What making a request's text needs (``engine.text``), on its first output from an
    engine: the tokens before that output's new ones, from a few prompt tokens on (the
    incremental detokeniser's context), of which the last ``num_output`` are output
    tokens emitted before this engine had the request (an imported or resumed one: their
    text is what its stop strings are searched in from the start); and its text options."""

    token_ids: tuple[int, ...]
    num_output: int
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass
class RequestOutput:
    """One request's progress in one engine step: only what is new. The step makes no
    text (``Engine.step_tokens``); ``engine.text`` fills ``text`` and may end the request
    at a stop string (``Engine.step`` does both)."""

    request_id: str
    new_token_ids: list[int]
    text: str  # new text (may lag tokens by an incomplete character or a possible stop string)
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per new token, when asked
    # prompt tokens 1.. (the first has none), on the output with the first token, when asked
    prompt_logprobs: list[PromptLogprob] | None = None
    scheduled_at: float | None = None  # time.time() when the engine first scheduled (or imported) it
    # finished with this error instead of a finish_reason: the request failed alone
    error: SequenceFailed | None = None
    # speculative decoding of this request on this engine, so far: tokens proposed, kept
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # on the request's first output from this engine: what making its text needs
    text_start: TextStart | None = None
    # it ended at its last new token, an EOS or stop token id (whose text is left out
    # unless ``include_stop_str_in_output``)
    stop_token: bool = False


@dataclass
class CompletionOutput:
    """A finished request, as ``Engine.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens, including a final EOS / stop token id
    text: str
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None  # prompt tokens 1.., when asked
    error: SequenceFailed | None = None  # it failed alone (finish_reason None; tokens before it stand)


@dataclass(frozen=True)
class PrefilledRequest:
    """A prefill-only request whose KV is ready to ship.

    The engine holds ``block_ids`` (KV of the first ``num_kv_tokens`` tokens of
    ``prompt_token_ids``) until ``Engine.release(request_id)``; nothing else
    writes to them meanwhile. ``output_token_ids`` holds the first sampled token.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_kv_tokens: int
    num_cached_tokens: int
    # the sliding layers' KV to send starts at block_ids[window_from] (wire.kv.KVDescriptor)
    window_from: int = 0
    # the LoRA adapter its KV was computed under: its digest ("" for the base model)
    adapter_digest: str = ""


@dataclass(frozen=True)
class TierCounters:
    """An engine's prefix reuse by tier, in blocks, cumulative since it started.
    ``capacity_blocks`` 0: it has no host tier (``engine.kv_tier``)."""

    capacity_blocks: int = 0
    held_blocks: int = 0  # blocks the host tier holds now
    saved: int = 0  # evicted from the engine's cache into the host tier
    reloaded: int = 0  # copied back from the host tier for a prompt (prefix hits of the tier)
    dropped: int = 0  # dropped by the host tier when full (least recently used)
    corrupt: int = 0  # failed their checksum when reloaded (dropped and recomputed)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load, for routing and status pages."""

    num_running: int  # sequences in the running batch (prefill or decode)
    num_waiting: int  # queued, not yet admitted
    num_pending_prompt_tokens: int  # prompt tokens of waiting and running sequences not yet computed
    num_blocks: int
    num_free_blocks: int
    # prompt tokens computed per second of the steps that computed any (a moving
    # average, mixed steps included); 0.0 until the first such step
    prefill_tokens_per_s: float = 0.0
    # decode-only steps, recent ones weighted most: mean sequences per step and seconds
    # per step (0.0 until the first such step)
    decode_batch: float = 0.0
    decode_step_s: float = 0.0
    num_preemptions: int = 0  # since the engine started (as vLLM's num_preemptions_total)
    # MoE models: rows (token, expert pairs) routed to each expert, all MoE layers summed,
    # since the engine started and over its last whole window of ``expert_window_s``
    # (empty for dense models; the window empty until one has passed); the experts are
    # split evenly over ``expert_ranks`` ranks in order (1: every rank computes every expert)
    expert_tokens_total: tuple[int, ...] = ()
    expert_tokens_recent: tuple[int, ...] = ()
    expert_window_s: float = 0.0
    expert_ranks: int = 1
    # prefix reuse: prompt tokens taken from the engine's own cache (device tier) and
    # reloaded from its host tier, since it started; the host tier's counters
    prefix_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    host_tier: TierCounters = TierCounters()
    # decode: tokens of imported requests whose KV it held already (not moved) and whose KV
    # moved in, since it started; of those moved in, the ones copied before a running
    # request moved here (live migration's pre-copy), while it still decoded elsewhere
    import_held_tokens: int = 0
    import_moved_tokens: int = 0
    import_precopied_tokens: int = 0
    # prompt-prefix tokens whose KV it lent to other workers, and copied in from them
    # (prefill workers pulling prefixes from each other), since it started
    prefix_lent_tokens: int = 0
    prefix_pulled_tokens: int = 0
    # requests that failed alone (``SequenceFailed``), as (kind, count) since it started; and
    # model steps that failed and were run again (all of them narrowed, some one by one)
    sequence_errors: tuple[tuple[str, int], ...] = ()
    steps_retried: int = 0
    speculation: SpeculationCounters = SpeculationCounters()  # speculative decoding, since it started
    # imported requests' KV checked by meaning (engine.meaning), by result: ok, mismatch, skipped
    meaning_checks: tuple[tuple[str, int], ...] = ()
    # the LoRA adapters it serves now, as (name, digest of its weights), by name
    lora_adapters: tuple[tuple[str, str], ...] = ()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


def rank_loads(expert_tokens: Sequence[int], ranks: int) -> list[int]:
    """Per rank, the rows routed to the experts it holds: ``expert_tokens`` (one count
    per expert) split evenly over ``ranks`` in order ([] when there are no counts)."""
    if not expert_tokens:
        return []
    per = len(expert_tokens) // max(1, ranks)
    return [sum(expert_tokens[r * per : (r + 1) * per]) for r in range(len(expert_tokens) // per)]


@dataclass(frozen=True)
class ThreadTimes:
    """Where an engine loop's thread spent its time (seconds, since the loop started;
    ``minus`` gives a window). ``on_cpu_s`` and ``runnable_s`` (ready, waiting for a core)
    are the kernel's (Linux ``schedstat``; 0 elsewhere); ``paced_s`` (asleep waiting
    for its consumer to take outputs) and ``idle_s`` (asleep waiting for work) the loop's
    own, the parts disjoint; what is left, ``blocked_s``, is time blocked otherwise: on
    a CPU worker, the GIL held by another thread of its process, and OpenMP's barrier
    while torch's helper threads wait for a core (an engine in a process of its own
    blocks about as long, ``docs/benchmarks.md``); on a GPU, device syncs and TP
    collectives too (``bench.serving_efficiency`` prints the split)."""

    wall_s: float
    on_cpu_s: float
    runnable_s: float
    paced_s: float
    idle_s: float

    @property
    def blocked_s(self) -> float:
        return self.wall_s - self.on_cpu_s - self.runnable_s - self.paced_s - self.idle_s

    def minus(self, earlier: ThreadTimes) -> ThreadTimes:
        return ThreadTimes(
            self.wall_s - earlier.wall_s,
            self.on_cpu_s - earlier.on_cpu_s,
            self.runnable_s - earlier.runnable_s,
            self.paced_s - earlier.paced_s,
            self.idle_s - earlier.idle_s,
        )

    def describe(self) -> str:
        """Each part as a share of the wall time."""
        parts = {
            "on CPU": self.on_cpu_s,
            "waiting for a core": self.runnable_s,
            "waiting for the outputs to be taken": self.paced_s,
            "idle": self.idle_s,
            "blocked otherwise (the GIL, OpenMP's barrier)": self.blocked_s,
        }
        wall = max(self.wall_s, 1e-9)
        return ", ".join(f"{name} {s / wall:.1%}" for name, s in parts.items())


@dataclass(frozen=True)
class FinishingPrefill:
    """A prefill-only request whose prompt completes in the step about to run: after
    that step's layer ``i`` returns, layer ``i`` of its KV is final in ``block_ids``."""

    request_id: str
    block_ids: tuple[int, ...]
    num_kv_tokens: int
    window_from: int = 0  # as PrefilledRequest's


class LayerObserver:
    """Told, on the driver rank, as a step's forward pass finishes each layer of the
    prompts that complete in that step (what layer-wise KV export builds on).

    ``step_begins`` is called before the forward pass of a step in which at least
    one prefill-only prompt completes, with those prompts; ``layer_done(i)`` after
    layer ``i`` wrote its KV, for ``i = 0 .. num_layers - 1`` in order. Both run on
    the engine's thread, inside ``Engine.step``: keep them short, never step the
    engine from them. An exception raised here fails the step.

    ``step_failed`` is called when a step that began failed before its last layer:
    the engine runs it again without the observer (``engine.containment``), so
    the layers it was told of are not final and no more will come for that step."""

    def step_begins(self, finishing: list[FinishingPrefill]) -> None:
        pass

    def step_failed(self) -> None:
        pass

    def layer_done(self, layer: int) -> None:
        pass
