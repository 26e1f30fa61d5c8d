"""The router's Prometheus metrics, in the text format, with vLLM's names under
``splitserve:`` (so a vLLM dashboard ports over by renaming the prefix).

Two sources, one registry (``prometheus_client``, never hand-written exposition):

- **Per request**, from its trace (``RequestMetrics.record``, a ``TraceSink`` of the
  dispatcher): the latency histograms, token and KV counters, outcomes. Every
  request counts once, when it ends.
- **Per worker and per pool**, read at scrape time from the ``WorkerRegistry``
  (figures the registry's polling brought in: the workers' figures reach the
  router by that one channel), the pools' sizes and the decider's counts.

::

    histograms (seconds)                               from the trace
    splitserve:time_to_first_token_seconds             admitted -> first token
    splitserve:inter_token_latency_seconds             between consecutive tokens' sample times
    splitserve:request_time_per_output_token_seconds   (e2e - ttft) / (output tokens - 1)
    splitserve:e2e_request_latency_seconds             admitted -> finished
    splitserve:request_queue_time_seconds              the queue phase
    splitserve:request_prefill_time_seconds            the prefill phase
    splitserve:request_handover_time_seconds           the kv_transfer phase (first token -> decode holds KV)
    splitserve:request_decode_time_seconds             the decode phase
    splitserve:kv_transfer_time_seconds                the decode worker's pull (bytes moving, verified)
    counters
    splitserve:prompt_tokens_total, splitserve:generation_tokens_total   (tokens the clients got)
    splitserve:kv_transfer_bytes_total
    splitserve:kv_handoffs_total{mode}                  KV pulls, mode: streamed (layer-wise, during
                                                       prefill) or whole (after it)
    splitserve:request_success_total{finished_reason}
    splitserve:request_failure_total{code}              (a gRPC code name; CANCELLED: the client left)
    splitserve:prefix_cache_queries_total, splitserve:prefix_cache_hits_total   (prompt tokens)
    splitserve:prefill_placement_total{placement,reason} (the decider's choices)
    splitserve:kv_transfer_failures_total{error,action} (action: recompute or fail)
    splitserve:prompt_tokens_from_decode_kv_total{how}  prompt tokens whose KV a decode worker's cache
                                                       held: copied to the prefill worker, or reused
                                                       in_place (prefilled on that decode worker)
    splitserve:requests_moved_total{reason}             running requests moved to another decode
                                                       worker (router.moves.MOVE_REASONS: operator,
                                                       drain, kv_full)
    splitserve:worker_replacements_total{pool}          (workers Ray gave up, replaced by the pool)
    splitserve:engine_loop_failures_total{pool}         (of those, workers whose engine loop stopped:
                                                       a fault no request could be blamed for)
    splitserve:worker_restarts_total{pool,worker}       its process restarted by Ray (it crashed)
    splitserve:sequence_errors_total{pool,worker,kind} requests that failed alone in its engine
                                                       (kind: wire.errors.SEQUENCE_ERROR_KINDS:
                                                       sampling, unsampleable, grammar,
                                                       detokenization, logprobs, kv_cache, forward)
    splitserve:model_steps_retried_total{pool,worker}  model steps that failed and were run again
    splitserve:kv_handoffs_verified_total{pool,worker,check,result}  taken-in KV checked before it
                                                       ran (check: meaning; result: ok, mismatch, skipped)
    splitserve:spec_decode_draft_tokens_total{pool,worker,method}     speculative decoding: tokens
    splitserve:spec_decode_accepted_tokens_total{pool,worker,method}  proposed, of those kept, and the
    splitserve:spec_decode_drafts_total{pool,worker,method}           sequence-steps that checked a
                                                       draft (acceptance rate: accepted / draft tokens;
                                                       mean accepted length: 1 + accepted / drafts)
    splitserve:ignored_fields_total                     unknown request fields ignored
                                                       (router.openai.ignore_unknown_fields)
    gauges
    splitserve:num_requests_running{pool,worker}       in its engine's running batch
    splitserve:num_requests_waiting{pool,worker}       queued in its engine
    splitserve:kv_cache_usage_perc{pool,worker}        used KV blocks / all (0..1, as vLLM)
    splitserve:num_preemptions_total{pool,worker}      from the engine (restarts from 0 with the worker)
    splitserve:expert_routed_tokens_total{pool,worker,rank}  MoE: (token, expert) pairs routed to the
                                                       experts rank holds (its rate: the expert load)
    splitserve:prefix_reused_tokens_total{pool,worker,source}  prompt tokens not computed: source
                                                       device (its KV cache), host (its host tier),
                                                       held (decode: the part of handed-over
                                                       prompts it held, so their KV did not move;
                                                       also counted as device or host), pulled
                                                       (prefill: copied in from another prefill
                                                       worker; also counted as device)
    splitserve:prefix_lent_tokens_total{pool,worker}   prefill: prompt-prefix tokens another
                                                       prefill worker copied from it
    splitserve:prefix_pulls_total{pool,worker,outcome} prefill: pulls of a prefix from another
                                                       prefill worker; outcome pulled, or failed
                                                       (moved nothing: the prefix was computed)
    splitserve:kv_imported_tokens_total{pool,worker}   decode: prompt tokens whose KV moved in
    splitserve:kv_tier_blocks_total{pool,worker,event} its host tier: saved, reloaded, dropped, corrupt
    splitserve:kv_tier_blocks_held{pool,worker}        blocks its host tier holds now
    splitserve:pool_replicas{pool,state}               state: current (routable), warming
                                                       (starting), draining, desired
    splitserve:num_requests_inflight                    admitted by the router, unfinished

Request metrics carry ``model_name``, as vLLM's do. Every series carries
``replica``: 0 for ``splitserve serve``, i for its router i (``cluster.replicas``),
each of which serves its own ``/metrics`` with its requests' series and its own
figures (placements, transfer failures, moves, in flight, batch caps) but not the workers'
and pools' (the ones above from ``num_requests_running`` to ``pool_replicas``),
which only router 0 exports: a scrape of every router sums correctly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.router.registry import Membership, WorkerRegistry
from splitserve.router.roles import Role
from splitserve.router.trace import RequestTrace
from splitserve.wire.outputs import rank_loads
from splitserve.wire.prefill import PrefillStats

__all__ = ["CONTENT_TYPE_LATEST", "PoolSize", "RequestMetrics", "RouterMetrics"]

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75)
_LATENCY += (1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_PER_TOKEN = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4)
_PER_TOKEN += (0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_TRANSFER = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class PoolSize:
    """A pool's size as its owner (the cluster's pools and autoscalers) sees it."""

    pool: str
    desired: int  # what the pool is being scaled to (its configured size without autoscaling)
    replaced: int = 0  # workers started in place of ones Ray would not bring back
    engine_failures: int = 0  # of those, workers whose engine loop had stopped


class RequestMetrics:
    """The per-request metrics: a ``TraceSink`` that counts each ended request once."""

    def __init__(self, prom: CollectorRegistry, model_name: str):
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"splitserve:{name}", doc, ["model_name"], registry=prom, buckets=buckets)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"splitserve:{name}", doc, ["model_name", *labels], registry=prom)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", _PER_TOKEN)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "A request's mean time per output token.", _PER_TOKEN
        )
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY)
        self.queue = histogram("request_queue_time_seconds", "Time before the prompt was begun.", _LATENCY)
        self.prefill = histogram("request_prefill_time_seconds", "Prompt begun to first token.", _LATENCY)
        self.handover = histogram(
            "request_handover_time_seconds", "First token to the decode worker holding the KV.", _LATENCY
        )
        self.decode = histogram("request_decode_time_seconds", "Decode began to last token.", _LATENCY)
        self.transfer = histogram("kv_transfer_time_seconds", "A KV pull on a decode worker.", _TRANSFER)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Output tokens sent to clients.")
        self.kv_bytes = counter("kv_transfer_bytes", "KV bytes pulled by decode workers.")
        self.handoffs = counter("kv_handoffs", "KV pulls by decode workers, streamed or whole.", "mode")
        self.success = counter("request_success", "Requests that finished.", "finished_reason")
        self.failure = counter("request_failure", "Requests that failed, by gRPC code.", "code")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in a prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens served from a prefix cache.")
        # requests under LoRA adapters, by adapter (the base model's are in the series above only)
        self.lora_requests = counter("lora_requests", "Requests under a LoRA adapter that ended.", "adapter")
        self.lora_tokens = counter(
            "lora_generation_tokens", "Output tokens sent under a LoRA adapter.", "adapter"
        )
        self.lora_ttft = Histogram(
            "splitserve:lora_time_to_first_token_seconds",
            "Time to first token under a LoRA adapter.",
            ["model_name", "adapter"],
            registry=prom,
            buckets=_LATENCY,
        )

    def record(self, trace: RequestTrace) -> None:
        m = self.model_name
        if trace.ok:
            self.success.labels(m, trace.outcome).inc()
        else:
            self.failure.labels(m, trace.outcome).inc()
        if trace.prompt_tokens:  # admitted (a request refused at the door has none)
            self.prompt_tokens.labels(m).inc(trace.prompt_tokens)
            self.cache_queries.labels(m).inc(trace.prompt_tokens)
            self.cache_hits.labels(m).inc(trace.cached_prompt_tokens)
            self.e2e.labels(m).observe(trace.e2e_s)
        self.generation_tokens.labels(m).inc(trace.output_tokens)
        ttft = trace.ttft_s
        if trace.adapter:
            self.lora_requests.labels(m, trace.adapter).inc()
            self.lora_tokens.labels(m, trace.adapter).inc(trace.output_tokens)
            if ttft is not None:
                self.lora_ttft.labels(m, trace.adapter).observe(ttft)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            if trace.ok and trace.output_tokens > 1:
                self.tpot.labels(m).observe((trace.e2e_s - ttft) / (trace.output_tokens - 1))
        times, itl = trace.token_times, self.itl.labels(m)  # one label lookup, not one per token
        for a, b in zip(times, times[1:]):
            itl.observe(max(0.0, b - a))
        phases = {s.name: s.seconds for s in trace.spans}
        for name, hist in (
            ("queue", self.queue),
            ("prefill", self.prefill),
            ("kv_transfer", self.handover),
            ("decode", self.decode),
        ):
            if name in phases and trace.prompt_tokens:
                hist.labels(m).observe(phases[name])
        if trace.kv_bytes:
            self.kv_bytes.labels(m).inc(trace.kv_bytes)
            self.handoffs.labels(m, "streamed" if trace.kv_streamed else "whole").inc()
            self.transfer.labels(m).observe(trace.kv_pull_s)


class _ClusterCollector(Collector):
    """Workers' and pools' gauges (where ``workers``), and the router's own figures, read
    from their owners at each scrape."""

    def __init__(
        self,
        registry: WorkerRegistry,
        pool_sizes: Callable[[], list[PoolSize]],
        inflight: Callable[[], int],
        placements: Callable[[], dict[tuple[str, str], int]],
        transfer_failures: Callable[[], dict[tuple[str, str], int]],
        batch_caps: Callable[[], dict[str, int]],
        workers: bool,
        moves: Callable[[], dict[str, int]] = dict,
    ):
        self.workers = workers
        self.moves = moves
        self.registry = registry
        self.pool_sizes = pool_sizes
        self.inflight = inflight
        self.placements = placements
        self.transfer_failures = transfer_failures
        self.batch_caps = batch_caps

    def collect(self) -> Iterator[Metric]:
        if self.workers:
            yield from self._workers()
            yield from self._pools()
        yield from self._router()

    def _workers(self) -> Iterator[Metric]:
        """Each worker's figures (the primary's: one copy in the cluster)."""
        labels = ["pool", "worker"]
        running = GaugeMetricFamily(
            "splitserve:num_requests_running", "Requests in the running batch.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "splitserve:num_requests_waiting", "Requests queued in the engine.", labels=labels
        )
        kv = GaugeMetricFamily("splitserve:kv_cache_usage_perc", "KV cache usage (0..1).", labels=labels)
        preemptions = CounterMetricFamily(
            "splitserve:num_preemptions", "Sequences preempted for lack of KV blocks.", labels=labels
        )
        experts = CounterMetricFamily(
            "splitserve:expert_routed_tokens",
            "MoE models: (token, expert) pairs routed to the experts each rank holds, all MoE layers.",
            labels=[*labels, "rank"],
        )
        reused = CounterMetricFamily(
            "splitserve:prefix_reused_tokens",
            "Prompt tokens not computed: from the KV cache (device), the host tier (host); held: those of "
            "handed-over prompts a decode worker had (their KV did not move; also in device or host); "
            "pulled: copied in from another prefill worker (also in device).",
            labels=[*labels, "source"],
        )
        lent = CounterMetricFamily(
            "splitserve:prefix_lent_tokens",
            "Prompt-prefix tokens other prefill workers copied from this one.",
            labels=labels,
        )
        pulls = CounterMetricFamily(
            "splitserve:prefix_pulls",
            "Pulls of a prompt prefix from another prefill worker: pulled, or failed (the prefix was "
            "computed instead).",
            labels=[*labels, "outcome"],
        )
        imported = CounterMetricFamily(
            "splitserve:kv_imported_tokens",
            "Prompt tokens whose KV moved into a decode worker.",
            labels=labels,
        )
        tier = CounterMetricFamily(
            "splitserve:kv_tier_blocks",
            "Host KV tier blocks: saved (evicted from the cache), reloaded, dropped (tier full), corrupt "
            "(checksum failed on reload).",
            labels=[*labels, "event"],
        )
        tier_held = GaugeMetricFamily(
            "splitserve:kv_tier_blocks_held", "Blocks a worker's host KV tier holds.", labels=labels
        )
        restarts = CounterMetricFamily(
            "splitserve:worker_restarts", "Times Ray restarted a worker's process.", labels=labels
        )
        seq_errors = CounterMetricFamily(
            "splitserve:sequence_errors",
            "Requests that failed alone in a worker's engine (the others in its batch went on), by kind.",
            labels=[*labels, "kind"],
        )
        retried = CounterMetricFamily(
            "splitserve:model_steps_retried", "Model steps that failed and were run again.", labels=labels
        )
        verified = CounterMetricFamily(
            "splitserve:kv_handoffs_verified",
            "Handed-over (and moved) requests whose KV a decode worker checked before running them, by "
            "check (meaning: the prompt's last position computed again) and result (ok, mismatch, skipped).",
            labels=[*labels, "check", "result"],
        )
        spec = {
            name: CounterMetricFamily(f"splitserve:spec_decode_{name}", what, labels=[*labels, "method"])
            for name, what in (
                ("draft_tokens", "Speculative decoding: tokens proposed."),
                ("accepted_tokens", "Speculative decoding: proposed tokens the target kept."),
                ("drafts", "Speculative decoding: sequence-steps that checked a draft."),
            )
        }
        info = GaugeMetricFamily(
            "splitserve:worker_info",
            "1 for each worker that joined, labelled with the revision of the weights it serves "
            "(workers pair only within one).",
            labels=[*labels, "revision"],
        )
        for w in self.registry.workers():
            if w.state == Membership.STARTING:
                continue
            restarts.add_metric([w.role, w.worker_id], w.restarts)
            if w.info is not None:
                info.add_metric([w.role, w.worker_id, w.revision], 1)
            if w.stats is None:
                continue
            e = w.stats.engine
            key = [w.role, w.worker_id]
            for kind, n in e.sequence_errors:
                seq_errors.add_metric([*key, kind], n)
            retried.add_metric(key, e.steps_retried)
            for result, n in e.meaning_checks:
                verified.add_metric([*key, "meaning", result], n)
            if s := e.speculation.method:
                spec["draft_tokens"].add_metric([*key, s], e.speculation.proposed_tokens)
                spec["accepted_tokens"].add_metric([*key, s], e.speculation.accepted_tokens)
                spec["drafts"].add_metric([*key, s], e.speculation.verified_steps)
            running.add_metric(key, e.num_running)
            waiting.add_metric(key, e.num_waiting)
            kv.add_metric(key, e.num_used_blocks / e.num_blocks if e.num_blocks else 0.0)
            preemptions.add_metric(key, e.num_preemptions)
            for rank, n in enumerate(rank_loads(e.expert_tokens_total, e.expert_ranks)):
                experts.add_metric([*key, str(rank)], n)
            for source, n in (
                ("device", e.prefix_hit_tokens),
                ("host", e.tier_hit_tokens),
                ("held", e.import_held_tokens),
                ("pulled", e.prefix_pulled_tokens),
            ):
                reused.add_metric([*key, source], n)
            if isinstance(w.stats, PrefillStats):
                lent.add_metric(key, e.prefix_lent_tokens)
                pulls.add_metric([*key, "pulled"], w.stats.prefix_pulls)
                pulls.add_metric([*key, "failed"], w.stats.prefix_pull_failures)
            imported.add_metric(key, e.import_moved_tokens)
            t = e.host_tier
            if t.capacity_blocks:
                for event, n in (
                    ("saved", t.saved),
                    ("reloaded", t.reloaded),
                    ("dropped", t.dropped),
                    ("corrupt", t.corrupt),
                ):
                    tier.add_metric([*key, event], n)
                tier_held.add_metric(key, t.held_blocks)
        yield from (
            running,
            waiting,
            kv,
            preemptions,
            experts,
            reused,
            lent,
            pulls,
            imported,
            tier,
            tier_held,
            restarts,
            seq_errors,
            retried,
            verified,
            *spec.values(),
            info,
        )

    def _pools(self) -> Iterator[Metric]:
        """Each pool's workers by state, and its replacements (the primary's)."""
        replicas = GaugeMetricFamily(
            "splitserve:pool_replicas", "Workers per pool and state.", labels=["pool", "state"]
        )
        replacements = CounterMetricFamily(
            "splitserve:worker_replacements",
            "Workers started in place of ones Ray would not bring back.",
            labels=["pool"],
        )
        engine_failures = CounterMetricFamily(
            "splitserve:engine_loop_failures",
            "Workers replaced because their engine loop stopped (a fault no request could be blamed for).",
            labels=["pool"],
        )
        for size in self.pool_sizes():
            workers = self.registry.workers(size.pool)
            replicas.add_metric([size.pool, "current"], sum(w.routable for w in workers))
            replicas.add_metric([size.pool, "warming"], sum(w.state == Membership.STARTING for w in workers))
            replicas.add_metric([size.pool, "draining"], sum(w.state == Membership.DRAINING for w in workers))
            replicas.add_metric([size.pool, "desired"], size.desired)
            replacements.add_metric([size.pool], size.replaced)
            engine_failures.add_metric([size.pool], size.engine_failures)
        yield from (replicas, replacements, engine_failures)

    def _router(self) -> Iterator[Metric]:
        """This router's own figures (each router's count of what it did)."""
        placement = CounterMetricFamily(
            "splitserve:prefill_placement",
            "Where prompts were prefilled, and why.",
            labels=["placement", "reason"],
        )
        for (where, why), n in self.placements().items():
            placement.add_metric([where, why], n)
        failures = CounterMetricFamily(
            "splitserve:kv_transfer_failures",
            "KV transfers that failed, by error and what followed.",
            labels=["error", "action"],
        )
        for (error, action), n in self.transfer_failures().items():
            failures.add_metric([error, action], n)
        moved = CounterMetricFamily(
            "splitserve:requests_moved",
            "Running requests moved to another decode worker, by why.",
            labels=["reason"],
        )
        for reason, n in sorted(self.moves().items()):
            moved.add_metric([reason], n)
        inflight = GaugeMetricFamily("splitserve:num_requests_inflight", "Requests admitted, not finished.")
        inflight.add_metric([], self.inflight())
        caps = GaugeMetricFamily(
            "splitserve:decode_batch_cap",
            "Requests a decode worker may be given at once under limits.max_decode_batch and "
            "limits.decode_tpot_ms (absent: no cap).",
            labels=["worker"],
        )
        for worker_id, cap in sorted(self.batch_caps().items()):
            caps.add_metric([worker_id], cap)
        yield from (placement, failures, moved, inflight, caps)


class RouterMetrics:
    """Everything ``/metrics`` shows, in one ``CollectorRegistry`` of its own (never the
    process-global one, so two routers in one process do not collide). Read on the
    router's loop: the registry it reads is not thread-safe."""

    def __init__(
        self,
        model_name: str,
        registry: WorkerRegistry,
        pool_sizes: Callable[[], list[PoolSize]],
        inflight: Callable[[], int],
        placements: Callable[[], dict[tuple[str, str], int]],
        transfer_failures: Callable[[], dict[tuple[str, str], int]] = dict,
        batch_caps: Callable[[], dict[str, int]] = dict,
        replica: int = 0,
        workers: bool = True,
        moves: Callable[[], dict[str, int]] = dict,
    ):
        self.prom = CollectorRegistry(auto_describe=True)  # unlabelled (the SLO planner reads it)
        self.requests = RequestMetrics(self.prom, model_name)
        self.ignored_fields = Counter(
            "splitserve:ignored_fields",
            "Unknown request fields ignored (router.openai.ignore_unknown_fields).",
            registry=self.prom,
        )
        self.prom.register(
            _ClusterCollector(
                registry, pool_sizes, inflight, placements, transfer_failures, batch_caps, workers, moves
            )
        )
        self._registry = registry
        self.decode_kv = Counter(
            "splitserve:prompt_tokens_from_decode_kv",
            "Prompt tokens whose KV a decode worker's cache held (a conversation's earlier turns): "
            "copied from it by the prefill worker, or reused where the prompt was prefilled in place.",
            ["model_name", "how"],
            registry=self.prom,
        )
        self._exposed = CollectorRegistry(auto_describe=False)
        self._exposed.register(_Labelled(self.prom, {"replica": str(replica)}))

    def record(self, trace: RequestTrace) -> None:
        self.requests.record(trace)
        if trace.prefill_worker and trace.prefix_pulled_tokens:  # copied from a decode worker's cache?
            holder = self._registry.get(trace.prefix_pulled_from)
            if holder is not None and holder.role != Role.PREFILL:
                self.decode_kv.labels(self.requests.model_name, "copied").inc(trace.prefix_pulled_tokens)
        elif not trace.prefill_worker and trace.cached_prompt_tokens:  # prefilled where it decodes
            decoder = self._registry.get(trace.decode_worker)
            if decoder is not None and decoder.role == Role.DECODE:  # not a colocated worker
                self.decode_kv.labels(self.requests.model_name, "in_place").inc(trace.cached_prompt_tokens)

    def render(self) -> bytes:
        """The exposition, Prometheus' text format (``CONTENT_TYPE_LATEST``): every series
        labelled ``replica``."""
        return generate_latest(self._exposed)


class _Labelled(Collector):
    """``inner``'s metrics, every sample with ``labels`` added."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]):
        self.inner, self.labels = inner, labels

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield out
