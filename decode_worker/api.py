"""What crosses the boundary of a decode worker: typed records, no tuples or dicts.
Plain data: importing this module loads no torch (a router unpickles these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.config import EngineConfig
from splitserve.engine.errors import SplitserveError
from splitserve.engine.outputs import EngineStats
from splitserve.engine.prefix_cache import PrefixUpdate
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import FinishReason
from splitserve.engine.validation import RequestValidator
from splitserve.kv_transfer.contract import Confirmation, KVHandoff


@dataclass(frozen=True)
class DecodeWorkerSpec:
    """How to build one decode worker (the cluster config fills every field). With
    ``backend`` None it takes no KV from elsewhere and prefills every request
    itself (colocated mode)."""

    worker_id: str
    engine: EngineConfig
    backend: str | None
    transfer_timeout_s: float  # bound on one KV pull
    max_admission_queue: int  # imported requests waiting for KV blocks; past it: Overloaded
    torch_threads: int | None = None
    cpu_ids: tuple[int, ...] | None = None  # pin the worker's process to these cores (Linux)


@dataclass(frozen=True)
class DecodeWorkerInfo:
    worker_id: str
    validator: RequestValidator
    colocated: bool  # prefills every request itself (no KV transfer backend)
    engine: str = ""  # what its engine chose (Engine.summary)


@dataclass(frozen=True)
class DecodeTask:
    """One request for a decode worker.

    With ``handoff`` set, the prompt's KV and the first ``output_token_ids``
    come from a prefill worker: the decode worker pulls the KV and continues
    from there, never re-emitting those tokens. Without it, the worker prefills
    ``prompt_token_ids`` and ``output_token_ids`` (tokens already sent, when a
    request resumes after a lost worker) itself, and continues after them as
    the undisturbed run would (the same seeded stream; ``max_tokens`` counts
    them).

    A handoff with no ``output_token_ids`` streams (layer-wise): the KV moves
    while the prefill worker still computes it, and the first token comes later,
    through ``DecodeWorker.first_token``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeout_s: float | None = None  # past it the worker aborts the request (DeadlineExceeded)
    output_token_ids: list[int] = field(default_factory=list)
    handoff: KVHandoff | None = None

    @property
    def first_token_later(self) -> bool:
        return self.handoff is not None and not self.output_token_ids


@dataclass(frozen=True)
class TokenBatch:
    """New tokens of one request since the previous batch (coalesced when the
    consumer is slower than the decode steps). The last batch of a request has
    ``finish_reason`` or ``error``.

    For an imported request the first batch comes right after the pull, with no
    tokens: ``transfer_s`` and the ``confirmations`` the backend could not
    deliver itself, which the consumer forwards to the prefill worker."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float]
    token_times: list[float]  # time.time() at which each token was sampled
    finish_reason: FinishReason | None
    num_cached_tokens: int
    # on the first batch of an imported request: the KV pull (less, streamed, its waits for layers)
    transfer_s: float | None = None
    confirmations: tuple[Confirmation, ...] = ()  # on that batch: to deliver to the prefill worker
    error: SplitserveError | None = None  # the request ended here with this error (tokens before it stand)
    # time.time() when this worker took the request into its batch: for an imported
    # request when its KV had landed (on the pull's batch), else when its engine began
    # the prompt; on every batch from then on
    started_at: float | None = None


@dataclass(frozen=True)
class DecodeStats:
    worker_id: str
    engine: EngineStats
    num_streams: int  # requests this worker is streaming
    num_waiting_for_blocks: int  # imported requests queued for KV blocks (FIFO)
    num_pulling: int  # imported requests whose KV is moving in
    prefix: PrefixUpdate | None = None  # its prefix cache's changes since the caller's cursor
