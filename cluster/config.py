"""The serving config: one validated pydantic model drives ``splitserve serve``,
the tests and the benchmarks. Loaded from ``cluster_configs/*.yaml``;
``cluster_configs/local.yaml`` is the embedded default.

Every field has a description (``splitserve serve --help-config`` prints
them). Invalid configs raise ``ValueError`` with the offending field named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIG_DIR = Path(__file__).resolve().parent.parent / "cluster_configs"
DEFAULT_CONFIG = "local.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    name: str = Field(
        "smollm2", description="smollm2 (the bundled SmolLM2-135M-Instruct), a .gguf file or an HF directory"
    )
    served_name: str | None = Field(None, description="the name clients use; default: derived from name")
    random_weights: bool = Field(False, description="read only the model's config and draw random weights")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and KV cache dtype; auto: bfloat16 where native, else float32"
    )
    max_model_len: int | None = Field(None, ge=2, description="context length cap; default: the model's")
    seed: int = Field(0, ge=0, description="seed for random weights and unseeded sampling")

    @property
    def public_name(self) -> str:
        if self.served_name:
            return self.served_name
        path = Path(self.name)
        return path.stem if path.suffix == ".gguf" else path.name or self.name


class EngineOptions(_Strict):
    block_size: int = Field(16, ge=1, description="tokens per KV block (must match across pools)")
    kv_cache_memory_mib: int = Field(256, ge=1, description="KV cache size per worker, MiB")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="token budget per model step; longer prompts are chunked"
    )
    max_num_seqs: int = Field(64, ge=1, description="sequences in a worker's batch at most")
    enable_prefix_caching: bool = Field(True, description="reuse KV of prompt prefixes seen before")
    attention_backend: Literal["auto", "sdpa", "cpu", "triton", "flash_attn"] = Field(
        "auto", description="attention implementation (triton: paged-decode kernel for CUDA, by name only)"
    )
    cuda_graphs: bool = Field(
        False, description="replay decode steps from CUDA graphs (needs attention_backend triton)"
    )
    quantization: Literal["none", "fp8", "int8"] = Field(
        "none",
        description="linear layers: fp8 (W8A8; FP8 tensor cores on sm_89+, suits compute-bound prefill), "
        "int8 (weight-only; halves the bytes memory-bound decode reads), or none",
    )


class AutoscalingSpec(_Strict):
    min_replicas: int = Field(1, ge=1, description="the pool never shrinks below this")
    max_replicas: int = Field(4, ge=1, description="the pool never grows past this")
    target: float = Field(
        ...,
        gt=0,
        description="load per worker to aim for: prefill, queued prompt tokens; "
        "decode/colocated, busy fraction (max of KV occupancy and running/max_num_seqs)",
    )
    interval_s: float = Field(1.0, gt=0, description="how often the policy looks at the load")
    upscale_delay_s: float = Field(2.0, ge=0, description="how long growth must be wanted before it happens")
    downscale_delay_s: float = Field(
        30.0, ge=0, description="how long shrinking must be wanted before it happens"
    )
    drain_timeout_s: float = Field(
        120.0, ge=0, description="how long a removed worker may finish its requests"
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class PoolSpec(_Strict):
    replicas: int = Field(1, ge=0, description="number of workers in this pool")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves per worker (per TP rank)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per worker (per TP rank)")
    tp_size: int = Field(
        1,
        ge=1,
        description="tensor-parallel ranks per worker, placed on one node (prefill pool only; "
        "decode workers merge a TP prefill group's KV heads)",
    )
    torch_threads: int | None = Field(None, ge=1, description="torch threads per worker; default: num_cpus")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the engine runs")
    cpu_ids: list[int] | None = Field(
        None, description="pin worker i of this pool to core cpu_ids[i % len] (Linux; None: no pinning)"
    )
    engine: EngineOptions = Field(default_factory=EngineOptions, description="engine options of this pool")
    autoscaling: AutoscalingSpec | None = Field(
        None, description="scale this pool on its phase's load (None: fixed)"
    )

    @model_validator(mode="after")
    def _check(self) -> PoolSpec:
        if self.engine.cuda_graphs and self.engine.attention_backend != "triton":
            raise ValueError("engine.cuda_graphs needs engine.attention_backend: triton")
        if self.engine.cuda_graphs and self.tp_size > 1:
            raise ValueError("engine.cuda_graphs needs tp_size 1")
        return self


class TransferSpec(_Strict):
    backend: Literal["nixl", "torch_dist", "ray"] = Field("nixl", description="KV transfer backend")
    lease_s: float = Field(30.0, gt=0, description="how long exported KV waits for a decode worker")
    timeout_s: float = Field(10.0, gt=0, description="bound on one KV pull")


class RouterSpec(_Strict):
    host: str = Field("127.0.0.1", description="address the gRPC router listens on")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0: any free port)")
    http_port: int | None = Field(
        8000, ge=0, le=65535, description="OpenAI-compatible HTTP port on the same host (0: any; null: off)"
    )
    tls_cert: str | None = Field(None, description="PEM certificate chain file; enables TLS with tls_key")
    tls_key: str | None = Field(None, description="PEM private key file")
    shutdown_grace_s: float = Field(5.0, ge=0, description="how long running calls may finish on shutdown")

    @model_validator(mode="after")
    def _check(self) -> RouterSpec:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both tls_cert and tls_key, or neither")
        return self


class LimitsSpec(_Strict):
    max_inflight_requests: int = Field(
        512, ge=1, description="requests admitted and unfinished; past it: RESOURCE_EXHAUSTED"
    )
    max_queued_prompt_tokens: int = Field(
        32768, ge=1, description="prompt tokens waiting per prefill worker; past it: RESOURCE_EXHAUSTED"
    )
    max_timeout_s: float | None = Field(None, gt=0, description="cap on any request's duration")


class PolicySpec(_Strict):
    local_prefill_below_tokens: int = Field(
        0, ge=0, description="prompts shorter than this are prefilled on the decode worker (0: never)"
    )
    prefix_affinity: bool = Field(
        False, description="send prompts with the same first block to one prefill worker"
    )


class RaySpec(_Strict):
    address: str | None = Field(
        None, description="Ray cluster to attach to ('auto', ray://...); None: start one"
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a Ray instance started here; default: all")


class ClusterConfig(_Strict):
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="separate prefill and decode pools, or workers that do both"
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

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.mode == "disaggregated":
            if self.prefill.replicas < 1 or self.decode.replicas < 1:
                raise ValueError("disaggregated mode needs at least one prefill and one decode worker")
            if self.prefill.engine.block_size != self.decode.engine.block_size:
                raise ValueError("prefill and decode pools must use the same block_size")
            if self.decode.tp_size > 1:
                raise ValueError("decode.tp_size must be 1: only prefill workers run tensor-parallel so far")
        elif self.colocated.tp_size > 1:
            raise ValueError("colocated.tp_size must be 1: only prefill workers run tensor-parallel so far")
        if self.mode == "colocated" and self.colocated.replicas < 1:
            raise ValueError("colocated mode needs at least one worker")
        return self

    def pools(self) -> dict[str, PoolSpec]:
        """The pools this mode runs, by role."""
        if self.mode == "colocated":
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

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
