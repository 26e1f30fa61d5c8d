"""The engine: a plain in-process library (no Ray, no gRPC) that runs one model.

Whole-request use::

    engine = Engine(EngineConfig())
    engine.add_request("Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...

The two halves disaggregated serving needs:

- prefill side: ``add_request(..., prefill_only=True)``; after the step that
  samples its first token the request is PREFILLED and ``prefilled(id)`` tells
  which blocks hold its KV. The engine keeps those blocks until ``release(id)``.
  A ``layer_observer`` is told, within the step, as each layer of such a
  prompt's KV is written (hashing and streaming KV layer by layer build on it).
- decode side: ``import_request(...)`` allocates blocks for incoming KV and
  returns their ids (the request is IMPORTING, not scheduled); the caller fills
  them (``kv_cache.write_blocks`` or a transfer library writing into
  ``kv_cache.tensor``) and calls ``activate(id)`` to start decoding, or
  ``abort(id)`` to give the blocks back.
  When the KV moves before prefill ends, the first token comes with ``activate``.

Those methods, and the prefix loans between engines, are in ``engine.kv_requests``
(``Engine`` inherits them). Building the parts (model, KV cache, scheduler, runner) is ``engine.build``;
this module is the request lifecycle. Every public method validates first
(``validate_request`` is the one place requests are checked) and raises
``InvalidRequest`` (a ``ValueError``) before touching any state, so bad input
never leaks blocks.
Not thread-safe: one thread drives an engine.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from splitserve.engine.build import build_engine
from splitserve.engine.containment import Containment, Ran, contained
from splitserve.engine.kv_requests import KVRequests
from splitserve.engine.lora_requests import LoRARequests
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.request_state import RequestState
from splitserve.engine.scheduler import ScheduledSeq
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.speculative.build import Target
from splitserve.engine.speculative.speculation import Speculation
from splitserve.engine.speculative.verify import kept
from splitserve.engine.step_rates import DecodeSteps, ExpertLoad, PrefillRate
from splitserve.engine.text import Texts
from splitserve.engine.tokenizer import Tokenizer
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import InvalidRequest, SequenceFailed, UnknownRequest
from splitserve.wire.kv import CompatInfo, checksum_kind
from splitserve.wire.outputs import (
    CompletionOutput,
    EngineStats,
    FinishingPrefill,
    LayerObserver,
    RequestOutput,
    SpeculationCounters,
    TierCounters,
)
from splitserve.wire.prefix import PrefixCursor, PrefixUpdate, prefix_root
from splitserve.wire.sampling import FinishReason, SamplingParams

log = logging.getLogger(__name__)


class Engine(KVRequests, LoRARequests):
    def __init__(
        self,
        config: EngineConfig,
        hf_config=None,
        tokenizer: Tokenizer | None = None,
        tp: TPGroup | None = None,
    ):
        """Load the model named by ``config`` (or build ``hf_config`` with random
        weights) and allocate the KV cache.

        With ``config.tp_size > 1`` (or ``ep_size > 1``) every rank's process builds an
        ``Engine`` with its joined ``tp`` group (``TPGroup.join``; of ``group_size``
        ranks), from the same config and seed. Rank 0 (the driver) is used like any
        engine; the others call ``follow()``, which returns once the driver calls
        ``stop_followers()``."""
        tp = tp or TPGroup.single()
        if tp.size != config.group_size:
            raise ValueError(
                f"config.tp_size x ep_size is {config.group_size} but the engine's group has {tp.size} ranks"
            )
        self.tp = tp
        self.config = config
        parts = build_engine(config, hf_config, tokenizer, tp)
        self.device, self.dtype = parts.device, parts.dtype
        self.model_config = parts.model_config
        self.max_model_len = parts.max_model_len
        self.capacity = parts.capacity  # KV tokens, max context and concurrency (engine.kv_sizing)
        self.model = parts.model
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.kv_cache = parts.kv_cache
        self.block_manager = parts.block_manager
        self.host_tier = parts.host_tier
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.validator = parts.validator
        self.loras = parts.loras  # its LoRA adapters (engine.lora), or None
        self._init_lora_scheduling()  # a request runs once its adapter has a slot (lora_requests)
        self.summary = parts.summary  # one line: dtype, threads or device, attention backend, KV blocks
        self.revision = parts.revision  # which weights (engine.model.revision): in the KV compat hash
        self.requests: dict[str, RequestState] = {}
        self._texts = Texts(self.tokenizer)  # the text of the requests ``step`` runs (the library's)
        self._prefill_rate = PrefillRate()
        self._decode_steps = DecodeSteps()
        moe = self.model_config.moe
        self._expert_load = ExpertLoad(moe.num_experts) if moe is not None else None
        # tokens of imported requests: held here already (hold_prefix), moved in; of those
        # moved in, copied before a running request's move (reserve_moving, fill_moving)
        self.import_held_tokens = self.import_moved_tokens = self.precopied_tokens = 0
        # prompt-prefix tokens lent to other workers (lend_prefix) and copied in from them
        self.lent_tokens = self.pulled_tokens = 0
        # told as each layer of a completing prefill-only prompt is written (driver rank only)
        self.layer_observer: LayerObserver | None = None
        # requests that failed alone (SequenceFailed), by kind, since it started
        self.sequence_errors: collections.Counter[str] = collections.Counter()
        # imported requests' KV checked by meaning (verify_import), by result: ok, mismatch, skipped
        self.meaning_checks: collections.Counter[str] = collections.Counter()
        self.containment = Containment(self.runner, self.tp.size, lambda: self.layer_observer)
        spec = config.speculative
        self.speculation = None  # proposals are made and checked on the driver rank only
        if spec is not None and self.tp.is_driver:
            self.speculation = Speculation(spec, Target.of_engine(self))

    # ---- requests ----------------------------------------------------------
    def kv_compat(self) -> CompatInfo:
        """What a peer's KV cache must agree with for KV to move between the two (the
        KV transfer handshake's compatibility hash): the model, its revision, the layout;
        with an FP8 cache its scales."""
        kv = self.kv_cache
        checksum = checksum_kind(kv.tensor.device.type)
        return CompatInfo(self.config.model, kv.layout, kv.scale_values(), self.revision, checksum)

    def add_request(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        messages: list[dict[str, str]] | None = None,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
        export_from_block: int = 0,
    ) -> str:
        """Queue a request given as text, token ids, or chat ``messages``; return its id.

        ``export_from_block`` (prefill-only): the reader of its KV holds the prompt's
        first that many full blocks already (``hold_prefix``), so ``prefilled`` and the
        layer observer name only the blocks after them.

        ``output_token_ids``: tokens this request already generated elsewhere (one
        resumed after its worker was lost). They are prefilled with the prompt and
        never emitted again; they count toward ``max_tokens`` and the stop checks,
        and seeded sampling goes on from the token after them, so the continuation
        equals the undisturbed run's."""
        params = params or SamplingParams()
        request_id = self._new_id(request_id)
        prompt_ids = self.validate_request(prompt, params, messages)
        done = list(output_token_ids or ())
        if len(done) >= params.max_tokens:
            raise InvalidRequest(f"{len(done)} tokens already generated; max_tokens is {params.max_tokens}")
        most = (len(prompt_ids) - 1) // self.block_manager.block_size
        if export_from_block and (not prefill_only or not 0 < export_from_block <= most):
            raise InvalidRequest(
                f"a reader can hold at most the {most} full blocks before a {len(prompt_ids)}-token "
                f"prompt's last token, of a prefill-only request; got {export_from_block}"
            )
        seq = self._sequence(request_id, prompt_ids, params, prefill_only)
        seq.export_from_block = export_from_block
        for t in done:
            seq.append_token(t)
        self.requests[request_id] = RequestState(seq, seq.num_tokens)
        self.scheduler.add(seq)
        return request_id

    def validate_request(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        messages: list[dict[str, str]] | None = None,
    ) -> list[int]:
        """Check a request against this engine (see ``RequestValidator.validate``);
        changes no state. Returns the prompt ids. An engine runs one sequence per
        request: ``n`` > 1 is the router's to fork (``SamplingParams.sequence``)."""
        if params.n != 1:
            raise InvalidRequest(f"this engine runs one sequence per request, not n={params.n}")
        if params.adapter is not None:
            if self.loras is None:
                raise InvalidRequest(
                    f"request names LoRA adapter {params.adapter!r}, but LoRA adapters are not enabled "
                    "on this engine (enable_lora)"
                )
            if params.adapter not in self.loras.served:
                loaded = ", ".join(sorted(self.loras.served)) or "none"
                raise InvalidRequest(
                    f"no LoRA adapter named {params.adapter!r} is loaded here (loaded: {loaded})"
                )
        return self.validator.validate(prompt, params, messages)

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks. False if unknown or done."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        self._finish(state, FinishReason.ABORT)
        self._texts.forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        """Load figures (``EngineStats``). On an expert-parallel group it gathers the
        ranks' expert counts: driver only, between steps, as ``step``."""
        sched, bm = self.scheduler, self.block_manager
        load = self._expert_load
        if load is not None:
            load.add(self.runner.take_expert_load())
        in_batch = [*sched.waiting, *sched.running]
        pending = sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in in_batch)
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_pending_prompt_tokens=pending,
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefill_tokens_per_s=self._prefill_rate.tokens_per_s,
            decode_batch=self._decode_steps.batch,
            decode_step_s=self._decode_steps.step_s,
            num_preemptions=sched.num_preemptions,
            expert_tokens_total=tuple(load.total) if load is not None else (),
            expert_tokens_recent=load.recent if load is not None else (),
            expert_window_s=load.recent_s if load is not None else 0.0,
            expert_ranks=self.config.ep_size,
            prefix_hit_tokens=bm.prefix_hits,
            tier_hit_tokens=bm.tier_hits,
            import_held_tokens=self.import_held_tokens,
            import_moved_tokens=self.import_moved_tokens,
            import_precopied_tokens=self.precopied_tokens,
            prefix_lent_tokens=self.lent_tokens,
            prefix_pulled_tokens=self.pulled_tokens,
            sequence_errors=tuple(sorted(self.sequence_errors.items())),
            steps_retried=self.containment.retried,
            host_tier=self.host_tier.counters() if self.host_tier is not None else TierCounters(),
            speculation=self.speculation.counters() if self.speculation else SpeculationCounters(),
            meaning_checks=tuple(sorted(self.meaning_checks.items())),
            lora_adapters=tuple(sorted(self.loras.served.items())) if self.loras is not None else (),
        )

    def prefix_update(self, cursor: PrefixCursor | None) -> PrefixUpdate:
        """The prefix-cache hashes this engine registered or dropped since ``cursor``."""
        return self.block_manager.prefix_update(cursor)

    # ---- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """``step_tokens`` with each output's text made in-line (``engine.text``): a
        stop string ends its request in this step, and text that cannot be made fails
        its request alone. The library's step; a worker's loop runs ``step_tokens`` and
        makes text on its own thread. Use one or the other on an engine."""
        outputs = self.step_tokens()
        for out in outputs:
            state = self.requests.get(out.request_id)  # None: it ended in this step
            try:
                stopped = self._texts.feed(out)
            except Exception as e:
                self._texts.forget(out.request_id)
                error = contained("detokenization", e)
                if state is not None:  # still running: it ends here, failed
                    self._fail(state, error, out)
                else:
                    self.sequence_errors[error.kind] += 1
                    out.finish_reason, out.error = None, error
                continue
            if stopped and state is not None:
                self._finish(state, FinishReason.STOP)
        return outputs

    def step_tokens(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; return what changed per request, as
        token ids (no text: ``engine.text``). Driver rank only under tensor parallelism.

        A request can only fail itself (``engine.containment``): a sequence whose
        sampling, grammar or stop check raises ends alone, its last output carrying a
        ``SequenceFailed``; a model step that raises is run again (no new admissions)
        and then sequence by sequence, and those that still fail end alone.
        ``step_tokens`` raises only for a failure no sequence can be blamed for."""
        if not self.tp.is_driver:
            raise RuntimeError("only TP rank 0 steps the engine; the other ranks call follow()")
        spec = self.speculation
        self._begin_lora_schedule()
        sched = self.scheduler.schedule(spec.drafts(self.scheduler.running, self.requests) if spec else None)
        outputs = [self._fail(self.requests[s.request_id], error) for s, error in self._end_lora_schedule()]
        for seq in sched.unschedulable:
            state = self.requests[seq.request_id]
            self._finish(state, FinishReason.LENGTH)
            outputs.append(state.output([]))
        if not sched.scheduled:
            return outputs
        prompt_tokens = sum(
            min(s.num_new_tokens, s.seq.num_prompt_tokens - s.seq.num_computed_tokens)
            for s in sched.scheduled
            if s.seq.num_computed_tokens < s.seq.num_prompt_tokens
        )
        started = time.perf_counter()
        ran = self.containment.run(sched.scheduled, self._layer_hook)
        took = time.perf_counter() - started
        if prompt_tokens:
            self._prefill_rate.add(prompt_tokens, took)
        else:
            self._decode_steps.add(len(sched.scheduled), took)
            if spec is not None:
                spec.stepped(took, sum(s.num_new_tokens for s in sched.scheduled), len(sched.scheduled))
        for r in ran:
            state = self.requests[r.entry.seq.request_id]  # before _advance may finish it
            out = self._advance(r, state) if r.error is None else None
            if r.error is not None:
                out = self._fail(state, r.error)
            if out is not None:
                outputs.append(out)
        return outputs

    def _advance(self, r: Ran, state: RequestState) -> RequestOutput | None:
        """Apply one sequence's share of a step: its KV computed, the tokens it keeps
        appended (one, or with a draft up to the first the target disagreed with:
        ``speculative.verify``), each with its text and stop check; its output. None
        when it sampled nothing. A part that raises sets ``r.error`` (kind: where) and
        the sequence is failed by the caller."""
        seq, draft = r.entry.seq, r.entry.draft
        computed_before = seq.num_computed_tokens
        part = "logprobs"
        try:
            seq.prompt_logprobs.extend(r.prompt_logprobs)
            part = "kv_cache"
            seq.num_computed_tokens += r.entry.num_new_tokens - len(draft)
            self.block_manager.commit_computed(seq)
            if self.block_manager.states is not None:
                self.block_manager.states.started(seq)  # its snapshot is behind it now
                if not draft:
                    self._keep_snapshot(seq)
            if not r.tokens:
                return None
            keep = kept(r.tokens, draft)
            new, logprobs, tops = r.tokens[:keep], r.logprobs[:keep], r.tops[:keep]
            if draft:
                self.speculation.verified(state, len(draft), sum(map(int.__eq__, new, draft)))
            for j, token in enumerate(new):
                if j:  # the token before it was a draft token: its KV was computed in this step
                    seq.num_computed_tokens += 1
                part = "grammar"
                seq.append_token(token, logprobs[j], tops[j])
                reason = state.check_stop(self.eos_token_ids, self.max_model_len)
                if reason is not None:
                    new, logprobs, tops = new[: j + 1], logprobs[: j + 1], tops[: j + 1]
                    self._finish(state, reason)
                    break
            else:
                if draft:
                    part = "kv_cache"
                    self.block_manager.commit_computed(seq)
                    self.block_manager.trim(seq)
                    if seq.state_slot is not None and keep <= len(draft):
                        _rewind_state(seq, computed_before)
                    elif seq.state_slot is not None:
                        self._keep_snapshot(seq)
                if seq.prefill_only:
                    self._park_prefilled(state)
            return state.output(
                new, [v for v in logprobs if v is not None], [v for v in tops if v is not None]
            )
        except Exception as e:
            r.error = contained(part, e)
            return None

    def _keep_snapshot(self, seq: Sequence) -> None:
        """A hybrid sequence's step wrote the state at a block boundary to its mark slot
        (``state_marked``): keep it as that block's snapshot, a cached prefix's start."""
        marked, seq.state_marked = seq.state_marked, None
        bm = self.block_manager
        h = bm.hash_of(seq, marked // bm.block_size - 1) if marked else None
        if h is not None:
            bm.states.register(seq, h, in_prompt=marked <= seq.num_prompt_tokens)

    def _fail(
        self, state: RequestState, error: SequenceFailed, out: RequestOutput | None = None
    ) -> RequestOutput:
        """End a request whose own step failed: its blocks freed, its last output (``out``,
        made finished, or a new one) says why."""
        self.sequence_errors[error.kind] += 1
        log.warning("request %s failed alone (%s): %s", state.seq.request_id, error.kind, error)
        self._finish(state, None)
        state.error = error
        if out is None:
            out = state.output([])
        out.finished, out.finish_reason, out.error = True, None, error
        return out

    def _layer_hook(self, scheduled: list[ScheduledSeq]) -> Callable[[int], None] | None:
        """Tell the layer observer which prefill-only prompts complete in this step and
        return its per-layer callback; None when there is no observer or no such prompt."""
        observer = self.layer_observer
        if observer is None:
            return None
        bs, kv = self.block_manager.block_size, self.kv_cache
        finishing = []
        for s in scheduled:
            if not (s.seq.prefill_only and s.samples):
                continue
            ids, window_from = self.transfer_ids(s.seq, s.seq.export_from_block, s.seq.num_tokens)
            finishing.append(
                FinishingPrefill(  # a hybrid model's states go with its KV: the slot this step writes
                    s.seq.request_id,
                    tuple(ids + kv.slot_blocks(s.seq.state_spare)),
                    s.seq.num_tokens - s.seq.export_from_block * bs,
                    window_from,
                )
            )
        if not finishing:
            return None
        observer.step_begins(finishing)
        return observer.layer_done

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run requests to completion (a convenience loop over ``step``)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        states = {i: self.requests[i] for i in ids}
        texts, last = dict.fromkeys(ids, ""), {}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in texts:
                    texts[out.request_id] += out.text
                    last[out.request_id] = out
        return [states[i].completion(texts[i], last.get(i)) for i in ids]

    def measure_rates(self, num_tokens: int, runs: int = 2, decode_steps: int = 8) -> tuple[float, float]:
        """Prefill ``runs`` prompts of ``num_tokens`` filler tokens, the last one then
        decoding ``decode_steps`` tokens alone, and make the last run's speeds what
        ``stats`` reports until real requests move them: a worker then has a prompt rate
        and a decode step time before its first request (the first run pays the one-time
        costs). Returns them: (prompt tokens/s, seconds per decode step of one sequence).
        Call with no request in flight."""
        if self.has_unfinished():
            raise RuntimeError("measure_rates needs an idle engine")
        num_tokens = max(1, min(num_tokens, self.max_model_len - 1 - decode_steps))
        for run in range(runs):
            last = run == runs - 1
            self._prefill_rate = PrefillRate(self._prefill_rate.decay)
            self._decode_steps = DecodeSteps(self._decode_steps.decay)
            # no speculation: a plain step's time is what the planner and the decider use
            steps = 1 + (decode_steps if last else 0)
            sampling = SamplingParams(max_tokens=steps, ignore_eos=True, speculate=False)
            self.generate([[run + 1] * num_tokens], sampling)
        return self._prefill_rate.tokens_per_s, self._decode_steps.step_s

    def follow(self, on_message: Callable[[Any], None] | None = None) -> int:
        """Non-driver TP ranks: run the driver's steps until ``stop_followers``, handing
        any other message the driver broadcasts to ``on_message``; returns the number
        of steps run."""
        if self.tp.is_driver:
            raise RuntimeError("TP rank 0 drives the engine; follow() is for the other ranks")
        return self.runner.follow(on_message)

    def stop_followers(self) -> None:
        """Driver: end the other ranks' ``follow()`` (a no-op without tensor parallelism)."""
        self.runner.stop_followers()

    def _sequence(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, prefill_only: bool = False
    ) -> Sequence:
        """A new sequence, with its structured-output grammar when it asks for one (the
        tokens appended to it from here on advance the grammar), its bad words as tokens."""
        params = self.validator.with_bad_words_ids(params)
        seq = Sequence(request_id, prompt_ids, params, prefill_only=prefill_only)
        if params.adapter is not None:  # validated: served here
            seq.lora_digest = self.loras.served[params.adapter]  # its slot: bind_lora
            seq.hash_root = prefix_root(seq.lora_digest)
        if params.structured is not None:
            seq.grammar = self.validator.grammar(params.structured)
        return seq

    def observe_layers(self, observer: LayerObserver | None) -> None:
        """Have ``observer`` told as each layer of a completing prefill-only prompt is
        written (a prefill worker's exporter; driver rank only)."""
        self.layer_observer = observer

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        return request_id

    def _get(self, request_id: str, status: SequenceStatus) -> RequestState:
        state = self.requests.get(request_id)
        if state is None or state.seq.status != status:
            raise UnknownRequest(f"no {status.value} request with id {request_id!r}")
        return state

    def _park_prefilled(self, state: RequestState) -> None:
        self.scheduler.remove(state.seq)
        state.seq.lora_slot = None  # it runs no more here: its LoRA slot is free for others
        state.seq.status = SequenceStatus.PREFILLED
        state.seq.finish_reason = FinishReason.PREFILL_DONE

    def _finish(self, state: RequestState, reason: FinishReason | None) -> None:
        seq = state.seq
        self.scheduler.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)


def _rewind_state(seq: Sequence, computed: int) -> None:
    """A hybrid sequence's draft was cut short: the state its step left has taken in the
    rejected tokens too, so it goes back to the state before the step (still in its
    spare slot: ``ModelRunner``) and the tokens after ``computed`` are computed again
    next step, the accepted ones with the new one (their KV is rewritten the same).
    Exact, at the price of computing the accepted tokens twice."""
    seq.state_slot, seq.state_spare = seq.state_spare, seq.state_slot
    seq.num_computed_tokens = computed
    seq.state_marked = None  # a boundary past the kept tokens' may hold rejected ones
