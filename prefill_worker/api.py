"""What crosses the boundary of a prefill worker: typed records, no tuples or dicts."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine import EngineConfig, EngineStats, FinishReason, RequestValidator, SamplingParams
from splitserve.engine.parallel import TPInit
from splitserve.kv_transfer.contract import Handshake, KVDescriptor, KVShard


@dataclass(frozen=True)
class PrefillWorkerSpec:
    """How to build one prefill worker."""

    worker_id: str
    engine: EngineConfig
    backend: str  # KV transfer backend name (splitserve.kv_transfer.backend_names())
    lease_s: float = 30.0  # how long exported KV waits for a decode worker to take it
    torch_threads: int | None = None  # torch intra-op threads; None: torch's default
    cpu_ids: tuple[int, ...] | None = None  # pin the worker's process to these cores (Linux)
    tp: TPInit | None = None  # this process's rank in the worker's TP group (None: TP=1)


@dataclass(frozen=True)
class PrefillWorkerInfo:
    """What a router needs from a worker once, at start-up."""

    worker_id: str
    validator: RequestValidator  # checks requests exactly as this worker's engine does
    handshake: Handshake  # the KV source's; decode workers connect with it
    shard_handshakes: tuple[Handshake, ...] = ()  # TP ranks 1.. of a TP group


@dataclass(frozen=True)
class PrefillTask:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeout_s: float | None = None  # past it the worker aborts the request (DeadlineExceeded)


@dataclass(frozen=True)
class PrefillResult:
    """A prefilled request: its first token and, unless the request already ended
    at that token, the descriptor of its KV (held under a lease until a decode
    worker confirms it, the lease ends, or ``abort`` releases it)."""

    request_id: str
    worker_id: str
    output_token_ids: list[int]  # the first sampled token
    text: str  # its text
    logprobs: list[float]
    token_time: float  # time.time() when it was sampled
    finish_reason: FinishReason | None  # set when the request ended at its first token
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    descriptor: KVDescriptor | None  # None when finish_reason is set
    handshake: Handshake
    shards: tuple[KVShard, ...] = ()  # TP ranks 1..: their KV heads of this request


@dataclass(frozen=True)
class PrefillStats:
    worker_id: str
    engine: EngineStats
    num_exports: int  # KV exports waiting for a decode worker
