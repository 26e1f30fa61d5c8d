"""The serving config: one validated pydantic model drives ``splitserve serve``,
the tests and the benchmarks. Loaded from ``cluster_configs/*.yaml``;
``cluster_configs/local.yaml`` is the embedded default.

Every field has a description (``splitserve serve --help-config`` prints
them). Invalid configs raise ``ValueError`` with the offending field named.

One set of defaults: a field that configures the engine takes its default
from ``EngineConfig`` (``_engine_default``), the router's limits and policy
are the router's own models (``router.policy``), and the worker specs have
no defaults for what the config sets; ``engine_config`` passes the fields
through by name. A test checks that no default is written twice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from splitserve.cluster.planner import PlannerSpec
from splitserve.kv_transfer import CLUSTER_BACKENDS
from splitserve.router.moves import Relief
from splitserve.router.policy import LimitsSpec, PolicySpec
from splitserve.router.policy import StrictModel as _Strict
from splitserve.router.roles import Role
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.kv import DEFAULT_LEASE_S

CONFIG_DIR = Path(__file__).resolve().parent.parent / "cluster_configs"
DEFAULT_CONFIG = "local.yaml"

_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _engine_default(name: str):
    """``EngineConfig``'s default for ``name``: the one place engine defaults are written."""
    return _ENGINE_DEFAULTS[name]


class ModelSpec(_Strict):
    name: str = Field(
        _engine_default("model"),
        description="smollm2 (the bundled SmolLM2-135M-Instruct), a .gguf file or an HF directory",
    )
    served_name: str | None = Field(None, description="the name clients use; default: derived from name")
    random_weights: bool = Field(
        _engine_default("random_weights"), description="read only the model's config and draw random weights"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        _engine_default("dtype"),
        description="weights and KV cache dtype; auto: bfloat16 where native, else float32",
    )
    max_model_len: int | None = Field(
        _engine_default("max_model_len"), ge=2, description="context length cap; default: the model's"
    )
    seed: int = Field(
        _engine_default("seed"), ge=0, description="seed for random weights and unseeded sampling"
    )
    generation_config: bool = Field(
        _engine_default("generation_config"),
        description="apply the model's generation_config.json (temperature, top_p, top_k, EOS ids) to "
        "requests that leave those unset; false: the server's own defaults (vLLM's --generation-config vllm)",
    )
    kv_layer_groups: bool = Field(
        _engine_default("kv_layer_groups"),
        description="a model with sliding-window and full layers (gpt-oss, Gemma 2 and 3): its KV cache in "
        "layer groups, each sliding layer holding only its window's blocks (docs/models.md); false: every "
        "layer the whole sequence, which a host KV tier and self speculation need",
    )
    enable_lora: bool = Field(
        _engine_default("enable_lora"),
        description="serve LoRA adapters over the model (vLLM's --enable-lora): a request names one as "
        "its model (docs/models.md)",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters by name: a PEFT adapter directory each, served by every worker from "
        "the start (vLLM's --lora-modules NAME=PATH); more are loaded at run time (/v1/load_lora_adapter)",
    )
    max_loras: int | None = Field(
        _engine_default("max_loras"),
        ge=1,
        description="adapters in a worker's slots at once (a batch mixes them; the others wait for a "
        "slot); unset: one per adapter of lora_modules",
    )
    max_cpu_loras: int | None = Field(
        _engine_default("max_cpu_loras"),
        ge=1,
        description="adapters a worker keeps read in host memory (the others are read again when a "
        "slot needs them); unset: max_loras",
    )
    max_lora_rank: int = Field(
        _engine_default("max_lora_rank"), ge=1, description="the highest adapter rank a worker takes"
    )

    @property
    def public_name(self) -> str:
        if self.served_name:
            return self.served_name
        path = Path(self.name)
        return path.stem if path.suffix == ".gguf" else path.name or self.name


_SPECULATIVE_DEFAULTS = SpeculativeConfig()  # its defaults, written once there


class SpeculativeOptions(_Strict):
    """Speculative decoding of a pool's decodes (``engine.speculative``)."""

    method: Literal["ngram", "draft", "self", "mtp"] = Field(
        _SPECULATIVE_DEFAULTS.method,
        description="ngram: prompt lookup, proposing the tokens that followed the latest earlier "
        "occurrence of the sequence's last few tokens (no model; wins where outputs copy their input); "
        "draft: a smaller model with the same vocabulary (draft_model) decodes greedily; self: the "
        "model's own first draft_layers layers and its LM head (no extra weights; needs tp_size 1). "
        "A draft's KV is computed on the decode worker from the tokens: prefill pools need no draft. "
        "mtp: the checkpoint's multi-token prediction layer (DeepSeek-V3), one token per step; its KV "
        "is a layer of the model's, so every pool runs the layer and hands it over (tp_size and "
        "ep_size 1 on every pool)",
    )
    draft_model: str | None = Field(
        _SPECULATIVE_DEFAULTS.draft_model,
        description="method draft: the draft model (as the pool's model: a path, a .gguf or smollm2), "
        "loaded whole on each decode worker's first rank",
    )
    draft_layers: int = Field(
        _SPECULATIVE_DEFAULTS.draft_layers,
        ge=0,
        description="method self: the model's first layers that draft",
    )
    adaptive: bool = Field(
        _SPECULATIVE_DEFAULTS.adaptive,
        description="adapt each request's proposed tokens to its acceptance and the measured price of "
        "a draft token (a proposer that cannot pay is turned off); false: num_tokens every step",
    )
    num_tokens: int = Field(
        _SPECULATIVE_DEFAULTS.num_tokens,
        ge=1,
        le=16,
        description="the most tokens proposed per sequence and step",
    )
    ngram_min: int = Field(
        _SPECULATIVE_DEFAULTS.ngram_min, ge=1, description="the shortest suffix n-gram looked up"
    )
    ngram_max: int = Field(
        _SPECULATIVE_DEFAULTS.ngram_max, ge=1, description="the longest suffix n-gram looked up"
    )

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeOptions:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"speculative ngram_min ({self.ngram_min}) is above ngram_max {self.ngram_max}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method draft needs draft_model (the draft's path or name)")
        if self.method == "self" and self.draft_layers < 1:
            raise ValueError("speculative method self needs draft_layers >= 1 (the model's first layers)")
        return self


class EngineOptions(_Strict):
    """Passed to ``EngineConfig`` field by field, under the same names."""

    block_size: int = Field(
        _engine_default("block_size"), ge=1, description="tokens per KV block (must match across pools)"
    )
    kv_cache_memory_mib: int | None = Field(
        _engine_default("kv_cache_memory_mib"),
        ge=1,
        description="KV cache size per worker (per rank), MiB; unset: on a GPU kv_cache_memory_fraction "
        "of the memory free after the weights, on a CPU 1024",
    )
    kv_cache_memory_fraction: float = Field(
        _engine_default("kv_cache_memory_fraction"),
        gt=0,
        le=1,
        description="on a GPU, without kv_cache_memory_mib: the share of the device memory free after "
        "the weights that the KV cache takes (the rest: activations, CUDA graphs)",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        _engine_default("kv_cache_dtype"),
        description="auto: the model's dtype; fp8: e4m3 with a scale per layer and KV head (the "
        "checkpoint's, else calibrated at start): twice the tokens per byte, half the bytes per KV "
        "handoff; runs on the sdpa attention backend. Prefill and decode pools must agree",
    )
    max_num_batched_tokens: int = Field(
        _engine_default("max_num_batched_tokens"),
        ge=1,
        description="token budget per model step; longer prompts are chunked",
    )
    max_num_seqs: int = Field(
        _engine_default("max_num_seqs"), ge=1, description="sequences in a worker's batch at most"
    )
    enable_prefix_caching: bool = Field(
        _engine_default("enable_prefix_caching"), description="reuse KV of prompt prefixes seen before"
    )
    host_kv_tier_mib: int = Field(
        _engine_default("host_kv_tier_mib"),
        ge=0,
        description="host memory (MiB) below the KV cache for prefix blocks it evicts, kept by content "
        "hash with a checksum and reloaded when a prompt asks for them again, instead of recomputing "
        "them (least recently used dropped when full); 0: no host tier. Needs tp_size and ep_size 1",
    )
    attention_backend: Literal["auto", "sdpa", "cpu", "triton", "flash_attn"] = Field(
        _engine_default("attention_backend"),
        description="attention implementation (auto: cpu kernel on CPU; on CUDA flash_attn if installed, "
        "else triton, the paged-decode kernel whose steps CUDA graphs capture)",
    )
    cuda_graphs: bool | None = Field(
        _engine_default("cuda_graphs"),
        description="replay decode steps from CUDA graphs; unset: on CUDA with triton attention "
        "and tp_size 1 (auto picks triton on CUDA); true needs attention_backend triton",
    )
    quantization: Literal["none", "fp8", "int8"] = Field(
        _engine_default("quantization"),
        description="linear layers: fp8 (W8A8; FP8 tensor cores on sm_89+, suits compute-bound prefill), "
        "int8 (weight-only; halves the bytes memory-bound decode reads), or none",
    )
    speculative: SpeculativeOptions | None = Field(
        _engine_default("speculative"),
        description="speculative decoding of this pool's decodes (a decode or colocated pool; a prefill "
        "pool only samples first tokens): tokens proposed cheaply, checked in one step, each request's "
        "count adapted to how many it keeps; tokens are the same as without (see docs/speculative.md). "
        "Unset: none. A request may opt out (speculate: false)",
    )


class AutoscalingSpec(_Strict):
    policy: Literal["proportional", "slo"] = Field(
        "proportional",
        description="proportional: this pool alone, on its load against target (cluster.autoscale); "
        "slo: the SLO planner sizes the prefill and decode pools together to meet `planner`'s TTFT and "
        "TPOT targets (cluster.planner); both pools must then use it",
    )
    min_replicas: int = Field(
        1,
        ge=0,
        description="the pool never shrinks below this (0 only for the prefill role in elastic mode: "
        "every worker then decodes and prefills its own prompts)",
    )
    max_replicas: int = Field(4, ge=1, description="the pool never grows past this")
    target: float | None = Field(
        None,
        gt=0,
        description="proportional only: load per worker to aim for: prefill, queued prompt tokens; "
        "decode/colocated, busy fraction (max of KV occupancy and running/max_num_seqs)",
    )
    interval_s: float = Field(1.0, gt=0, description="how often the policy looks at the load")
    upscale_delay_s: float = Field(2.0, ge=0, description="how long growth must be wanted before it happens")
    downscale_delay_s: float = Field(
        30.0, ge=0, description="how long shrinking must be wanted before it happens"
    )
    drain_timeout_s: float = Field(
        120.0, ge=0, description="how long a removed worker may finish (or move off) its requests"
    )
    drain: Literal["migrate", "wait"] = Field(
        "migrate",
        description="a decode or colocated worker removed on scale-in: migrate moves its running "
        "requests to the others (with their KV where the worker can export it, else by recompute) "
        "and is gone in seconds; wait lets them finish there (up to drain_timeout_s)",
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        if self.policy == "proportional" and self.target is None:
            raise ValueError("autoscaling with policy proportional needs a target")
        return self


class PoolSpec(_Strict):
    replicas: int = Field(1, ge=0, description="number of workers in this pool")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves per worker (per TP rank)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per worker (per TP rank)")
    tp_size: int = Field(
        _engine_default("tp_size"),
        ge=1,
        description="tensor-parallel ranks per worker, placed on one node (any pool; the KV handoff "
        "maps KV heads between prefill and decode groups of any sizes)",
    )
    ep_size: int = Field(
        _engine_default("ep_size"),
        ge=1,
        description="expert-parallel ranks per worker (MoE models; decode and colocated pools): the routed "
        "experts split over them, attention data-parallel (each rank its own sequences and its share of the "
        "KV cache); needs tp_size 1. A worker is tp_size x ep_size ranks",
    )
    torch_threads: int | None = Field(None, ge=1, description="torch threads per worker; default: num_cpus")
    device: Literal["auto", "cpu", "cuda"] = Field(
        _engine_default("device"), description="where the engine runs"
    )
    cpu_ids: list[int] | None = Field(
        None, description="pin worker i of this pool to core cpu_ids[i % len] (Linux; None: no pinning)"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment variables of this pool's worker processes (every TP rank), set before "
        "they start, e.g. {GOMP_SPINCOUNT: '2000'}: on a CPU worker whose cores the router and its own "
        "threads share, a short OpenMP spin served 1.17x the tokens/s at full load, at about 1.1x the TPOT "
        "at low load (docs/benchmarks.md)",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each worker (each TP rank) reserves, e.g. "
        "{splitserve_prefill: 1}: its workers land only on nodes that advertise them (phase placement)",
    )
    placement_timeout_s: float = Field(
        600.0,
        gt=0,
        description="how long a new worker may wait for Ray to place it (e.g. for Ray's autoscaler to "
        "launch a node with its resources); past it the worker is given up with an error",
    )
    engine: EngineOptions = Field(default_factory=EngineOptions, description="engine options of this pool")
    engine_process: bool = Field(
        False,
        description="colocated pool, tp_size and ep_size 1: each worker runs its engine in a process of its "
        "own (engine/process.py), so that no other thread of the worker (Ray's, the one making text, the "
        "token server) shares the engine's interpreter; measured in docs/benchmarks.md",
    )
    autoscaling: AutoscalingSpec | None = Field(
        None, description="scale this pool on its phase's load (None: fixed)"
    )

    @model_validator(mode="after")
    def _check(self) -> PoolSpec:
        for name in self.env:
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"env: {name!r} is not an environment variable's name")
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(
                    f"resources: reserve {name} with num_cpus / num_gpus, not as a custom resource"
                )
            if amount <= 0:
                raise ValueError(f"resources.{name} must be positive, got {amount}")
        if self.engine.cuda_graphs and self.engine.attention_backend != "triton":
            raise ValueError("engine.cuda_graphs needs engine.attention_backend: triton")
        if self.engine.cuda_graphs and self.tp_size > 1:
            raise ValueError("engine.cuda_graphs needs tp_size 1")
        if self.ep_size > 1 and self.tp_size > 1:
            raise ValueError("ep_size > 1 runs attention data-parallel: tp_size must be 1 with it")
        if self.engine_process and self.ranks > 1:
            raise ValueError("engine_process needs tp_size and ep_size 1 (a group's ranks step together)")
        return self

    @property
    def ranks(self) -> int:
        """Processes per worker: tp_size x ep_size."""
        return self.tp_size * self.ep_size


class TransferSpec(_Strict):
    backend: Literal[CLUSTER_BACKENDS] = Field("nixl", description="KV transfer backend")
    lease_s: float = Field(
        DEFAULT_LEASE_S, gt=0, description="how long exported KV waits for a decode worker"
    )
    timeout_s: float = Field(
        10.0, gt=0, description="bound on one KV pull (a handover, or a prefix copied between prefill ones)"
    )
    stream_layers: bool = Field(
        True,
        description="hand each prompt's KV over layer by layer while its last prefill step computes it, so "
        "the decode worker's pull overlaps prefill (nixl; other backends and TP prefill groups hand over "
        "whole caches); false: whole caches, once prefill ends",
    )
    verify_meaning: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="the share of handed-over (and moved) requests whose KV the decode worker checks by "
        "meaning before it runs them: it computes the prompt's last position again over the KV it received "
        "and compares that position's K/V (and a greedy first token) with the source's; a "
        "mismatch is a failed transfer (on_failure). 0 or off: never, 1 or always: every request (decode "
        "0.92x the tokens/s of none on SmolLM2 bf16 here; 0.25: 0.99x: bench/handoff_faults)",
    )
    on_failure: Literal["recompute", "fail"] = Field(
        "recompute",
        description="a KV transfer that fails (refused, corrupt, timed out, lease over, source gone): "
        "recompute = the decode worker prefills the request itself, within its deadline; fail = the "
        "request ends with UNAVAILABLE",
    )

    @field_validator("verify_meaning", mode="before")
    @classmethod
    def _always_or_off(cls, v):
        return {"always": 1.0, "off": 0.0}.get(v, v) if isinstance(v, str) else v


class OpenAISpec(_Strict):
    ignore_unknown_fields: bool = Field(
        False,
        description="answer a request carrying fields neither OpenAI nor vLLM defines instead of a 400 "
        "listing them; each is logged and counted in splitserve:ignored_fields_total (fields known and "
        "refused still get a 400: docs/api.md)",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] = Field(
        "hermes",
        description="how chat output is read for tool calls under tool_choice auto: hermes (Hermes, Qwen: "
        "<tool_call>{...}</tool_call>) or llama3_json (Llama 3: the output one JSON call)",
    )
    reasoning_parser: Literal["think", "harmony"] | None = Field(
        None,
        description="think: a chat output that begins with <think> is reasoning up to </think> "
        "(reasoning_content), content after it (DeepSeek-R1, Qwen 3); harmony: gpt-oss's channels, "
        "analysis as reasoning_content, final as content, messages to functions.NAME as tool_calls; "
        "null: all content",
    )


class KVReliefSpec(_Strict):
    """Live migration instead of preemption: after each stats poll, a decode worker whose
    KV cache is nearly full has one of its requests moved, with its KV, to a worker of
    its revision with room, before its engine must preempt a sequence (and compute it
    again). Workers that cannot export their KV (TP or EP groups) are left to preempt."""

    above: float = Field(0.9, gt=0, le=1, description="a decode worker this full (KV blocks in use) sheds")
    below: float = Field(
        0.75, gt=0, le=1, description="...to a worker at most this full once it holds the request"
    )

    @model_validator(mode="after")
    def _order(self) -> KVReliefSpec:
        if self.below >= self.above:
            raise ValueError(
                f"kv_relief: below ({self.below}) must be under above ({self.above}), or requests "
                "would move back and forth"
            )
        return self

    def relief(self) -> Relief:
        return Relief(self.above, self.below)


class RouterSpec(_Strict):
    host: str = Field("127.0.0.1", description="address the gRPC router listens on")
    replicas: int = Field(
        1,
        ge=1,
        le=64,
        description="router processes serving the same gRPC and HTTP ports on this node (SO_REUSEPORT: "
        "the kernel spreads connections over them): splitserve serve itself and replicas - 1 Ray actors "
        "beside it, replaced when they die. Admission limits are split between them "
        "(docs/cluster.md); with metrics_port set, replica i serves /metrics on metrics_port + i",
    )
    node_resource: str | None = Field(
        "splitserve_router",
        description="in a Ray cluster, every other node runs a router of its own (a Ray actor, "
        "restarted when it dies) per whole unit of this resource it offers, on the same host and "
        "ports (several on one node share them, as replicas do), so a load balancer or DNS can front "
        "every node; set it in a node type's resources in the ray up YAML. Admission limits are "
        "split between all routers (null: no node routers)",
    )
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0: any free port)")
    http_port: int | None = Field(
        8000, ge=0, le=65535, description="OpenAI-compatible HTTP port on the same host (0: any; null: off)"
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="a port serving only Prometheus /metrics (0: any; null: none). The HTTP port serves "
        "/metrics too; this is for a router without one",
    )
    traces_kept: int = Field(
        100, ge=0, description="finished requests' traces kept for `splitserve status --traces`"
    )
    otel_endpoint: str | None = Field(
        None,
        description="an OpenTelemetry collector (host:port, OTLP over gRPC) that receives one trace per "
        "request; needs pip install 'splitserve[otel]' (null: no export)",
    )
    otel_service_name: str = Field("splitserve", description="the service.name the exported traces carry")
    api_keys_file: str | None = Field(
        None,
        description="a file of API keys, one per line: every gRPC call (but health checks) and every "
        "HTTP /v1 request must then carry 'authorization: Bearer KEY'; reloaded when the file changes "
        "or on SIGHUP (null: no authentication)",
    )
    tls_cert: str | None = Field(
        None, description="PEM certificate chain file; enables TLS (gRPC and HTTPS) with tls_key"
    )
    tls_key: str | None = Field(None, description="PEM private key file")
    shutdown_grace_s: float = Field(5.0, ge=0, description="how long running calls may finish on shutdown")
    kv_relief: KVReliefSpec | None = Field(
        default_factory=KVReliefSpec,
        description="move requests off decode workers whose KV cache is nearly full (null: never; "
        "their engines preempt when full)",
    )
    openai: OpenAISpec = Field(default_factory=OpenAISpec, description="the OpenAI-compatible HTTP endpoint")
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template file used in place of the model's (gRPC and HTTP; a "
        "request's own chat_template still wins)",
    )

    @model_validator(mode="after")
    def _template_exists(self) -> RouterSpec:
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"router.chat_template: no file {self.chat_template!r}")
        return self

    @model_validator(mode="after")
    def _check(self) -> RouterSpec:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both tls_cert and tls_key, or neither")
        return self


class RaySpec(_Strict):
    address: str | None = Field(
        None, description="Ray cluster to attach to ('auto', ray://...); None: start one"
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a Ray instance started here; default: all")


class ClusterConfig(_Strict):
    mode: Literal["disaggregated", "colocated", "elastic"] = Field(
        "disaggregated",
        description="separate prefill and decode pools, or workers that do both; elastic: the prefill and "
        "decode pools are roles over one set of workers, each one engine that serves either role "
        "(elastic_worker), whose split the SLO planner moves with the load (a worker switches role in "
        "seconds, without reloading; each pool's autoscaling min/max_replicas bound its role)",
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="the model every worker serves")
    prefill: PoolSpec = Field(default_factory=PoolSpec, description="prefill pool (disaggregated mode)")
    decode: PoolSpec = Field(default_factory=PoolSpec, description="decode pool (disaggregated mode)")
    colocated: PoolSpec = Field(
        default_factory=lambda: PoolSpec(replicas=2),
        description="workers that do both phases (colocated mode)",
    )
    transfer: TransferSpec = Field(default_factory=TransferSpec, description="how KV moves")
    router: RouterSpec = Field(default_factory=RouterSpec, description="the gRPC front door")
    limits: LimitsSpec = Field(default_factory=LimitsSpec, description="admission limits (backpressure)")
    policy: PolicySpec = Field(default_factory=PolicySpec, description="routing policy")
    ray: RaySpec = Field(default_factory=RaySpec, description="where Ray runs")
    planner: PlannerSpec | None = Field(
        None, description="the SLO planner's targets and damping (for pools with autoscaling.policy: slo)"
    )

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        slo = [
            r for r, p in self.pools().items() if p.autoscaling is not None and p.autoscaling.policy == "slo"
        ]
        if slo:
            if self.mode == "colocated" or sorted(slo) != ["decode", "prefill"]:
                raise ValueError(
                    "autoscaling.policy slo sizes the prefill and decode pools together: "
                    "set it on both, in disaggregated or elastic mode"
                )
            if self.planner is None:
                raise ValueError("autoscaling.policy slo needs a planner section (ttft_ms, tpot_ms)")
        if self.mode == "elastic":
            self._check_elastic(slo)
        for role, pool in self.pools().items():
            if pool.autoscaling is not None and pool.autoscaling.min_replicas < 1:
                if (self.mode, role) != ("elastic", "prefill"):
                    raise ValueError(
                        f"{role}.autoscaling.min_replicas must be >= 1: only the prefill role of an "
                        "elastic cluster may shrink to none (its decode workers then prefill)"
                    )
        if self.mode in ("disaggregated", "elastic"):
            if self.prefill.ep_size > 1:
                raise ValueError(
                    "prefill.ep_size must be 1: prefill runs tensor-parallel (its batches are large enough "
                    "to keep every rank's GEMMs busy); expert parallelism is for decode and colocated pools"
                )
            prefill_floor = 0 if self.mode == "elastic" and self.prefill.autoscaling.min_replicas == 0 else 1
            if self.prefill.replicas < prefill_floor or self.decode.replicas < 1:
                raise ValueError(
                    "disaggregated mode needs at least one prefill and one decode worker (elastic mode may "
                    "start with no prefill worker where prefill.autoscaling.min_replicas is 0)"
                )
            if self.prefill.engine.block_size != self.decode.engine.block_size:
                raise ValueError("prefill and decode pools must use the same block_size")
            kv_dtypes = (self.prefill.engine.kv_cache_dtype, self.decode.engine.kv_cache_dtype)
            if kv_dtypes[0] != kv_dtypes[1]:
                raise ValueError(
                    f"prefill and decode pools must use the same kv_cache_dtype (prefill {kv_dtypes[0]}, "
                    f"decode {kv_dtypes[1]}): the KV is handed over as it is stored"
                )
        if self.mode != "colocated" and (self.prefill.engine_process or self.decode.engine_process):
            raise ValueError(
                "engine_process is for colocated pools: a worker that hands KV over keeps its engine in "
                "its own process, where the transfer library registers the KV cache"
            )
        if self.mode == "colocated" and self.colocated.replicas < 1:
            raise ValueError("colocated mode needs at least one worker")
        if self.runs_mtp and any(p.tp_size * p.ep_size > 1 for p in self.pools().values()):
            raise ValueError(
                "speculative method mtp runs the model's multi-token prediction layer on every pool "
                "(its KV is handed over with the rest), which needs tp_size and ep_size 1 on each"
            )
        return self

    @property
    def runs_mtp(self) -> bool:
        """Whether some pool speculates with the MTP layer, so that every pool runs it
        (``EngineConfig.mtp_layer``: its KV is a layer of the handed-over KV)."""
        specs = [p.engine.speculative for p in self.pools().values()]
        return any(s is not None and s.method == "mtp" for s in specs)

    def _check_elastic(self, slo: list[str]) -> None:
        """Elastic workers are the same workers in either pool: one engine, one process."""
        p, d = self.prefill, self.decode
        if not slo:
            raise ValueError(
                "elastic mode moves the prefill:decode split with the load: set autoscaling.policy slo "
                "(and min/max_replicas, each role's bounds) on both pools, and a planner section"
            )
        if (p.engine, p.device, p.num_cpus, p.num_gpus, p.resources) != (
            d.engine,
            d.device,
            d.num_cpus,
            d.num_gpus,
            d.resources,
        ):
            raise ValueError(
                "in elastic mode the prefill and decode pools are roles of the same workers: their engine, "
                "device, num_cpus, num_gpus and resources must be equal"
            )
        if p.tp_size != 1 or d.tp_size != 1 or d.ep_size != 1:
            raise ValueError("elastic workers are one process each: tp_size and ep_size 1")

    @property
    def elastic_workers(self) -> int:
        """How many workers an elastic cluster runs (the two roles' first replicas)."""
        return self.prefill.replicas + self.decode.replicas

    def engine_config(self, role: str) -> EngineConfig:
        """The engine config of a worker of pool ``role``: every field passed through by name."""
        pool = self.pools()[role]
        model = self.model.model_dump(exclude={"name", "served_name"})
        return EngineConfig(
            model=self.model.name,
            device=pool.device,
            tp_size=pool.tp_size,
            ep_size=pool.ep_size,
            mtp_layer=self.runs_mtp,
            **model,
            **pool.engine.model_dump(),
        )

    def pools(self) -> dict[str, PoolSpec]:
        """The pools this mode runs, by role."""
        if self.mode == "colocated":
            return {Role.COLOCATED: self.colocated}
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode}

    @classmethod
    def load(cls, path: str | Path | None = None) -> ClusterConfig:
        """Read a YAML config (default: the embedded ``local.yaml``, whose values are
        also the models' defaults, for installs without the repo). Raises ``ValueError``."""
        if path is None:
            path = CONFIG_DIR / DEFAULT_CONFIG
            if not path.exists():
                return cls()
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise ValueError(f"cannot read config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"config {path} is not valid YAML: {e}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"config {path} is invalid:\n{e}") from None


def describe(model: type[BaseModel] = ClusterConfig, prefix: str = "") -> list[str]:
    """One line per field, with its description and default: the config's reference."""
    lines = []
    for name, f in model.model_fields.items():
        sub = f.annotation if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) else None
        if sub is not None:
            lines.append(f"{prefix}{name}: {f.description}")
            lines.extend(describe(sub, prefix + "  "))
        else:
            lines.append(
                f"{prefix}{name}: {f.description} (default: {f.get_default(call_default_factory=True)!r})"
            )
    return lines
