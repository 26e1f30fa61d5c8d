"""What crosses the boundary of a decode worker: typed records, no tuples or dicts."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine import EngineConfig, EngineStats, FinishReason, RequestValidator, SamplingParams
from splitserve.kv_transfer.contract import Handshake, KVDescriptor, KVShard


@dataclass(frozen=True)
class DecodeWorkerSpec:
    """How to build one decode worker. With ``backend`` None it takes no KV from
    elsewhere and prefills every request itself (colocated mode)."""

    worker_id: str
    engine: EngineConfig
    backend: str | None
    transfer_timeout_s: float = 10.0  # bound on one KV pull
    torch_threads: int | None = None
    cpu_ids: tuple[int, ...] | None = None  # pin the worker's process to these cores (Linux)


@dataclass(frozen=True)
class DecodeWorkerInfo:
    worker_id: str
    validator: RequestValidator
    colocated: bool  # prefills every request itself (no KV transfer backend)


@dataclass(frozen=True)
class DecodeTask:
    """One request for a decode worker.

    With ``descriptor`` set, the prompt's KV and the first ``output_token_ids``
    come from a prefill worker: the decode worker pulls the KV and continues
    from there, never re-emitting those tokens. Without it, the worker prefills
    ``prompt_token_ids`` itself."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeout_s: float | None = None  # past it the worker aborts the request (DeadlineExceeded)
    output_token_ids: list[int] = field(default_factory=list)
    descriptor: KVDescriptor | None = None
    handshake: Handshake | None = None  # the source's, for descriptor
    shards: tuple[KVShard, ...] = ()  # a TP prefill group's other ranks: merged into this worker's heads


@dataclass(frozen=True)
class TokenBatch:
    """New tokens of one request since the previous batch (coalesced when the
    consumer is slower than the decode steps). The last batch has ``finish_reason``."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    token_times: list[float]  # time.time() at which each token was sampled
    finish_reason: FinishReason | None
    num_cached_tokens: int
    transfer_s: float | None = None  # on the first batch of an imported request: the KV pull


@dataclass(frozen=True)
class DecodeStats:
    worker_id: str
    engine: EngineStats
    num_streams: int  # requests this worker is streaming
