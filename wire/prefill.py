"""What crosses the boundary of a prefill worker: typed records, no tuples or dicts.
Plain data: importing this module loads no torch (a router unpickles these)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.wire.config import EngineConfig
from splitserve.wire.kv import Confirmation, Handshake, KVHandoff
from splitserve.wire.outputs import EngineStats, PromptLogprob, TopLogprobs
from splitserve.wire.prefix import PrefixUpdate
from splitserve.wire.sampling import FinishReason, SamplingParams
from splitserve.wire.tp import TPInit
from splitserve.wire.validation import RequestValidator


@dataclass(frozen=True)
class PrefillWorkerSpec:
    """How to build one prefill worker (the cluster config fills every field)."""

    worker_id: str
    engine: EngineConfig
    backend: str  # KV transfer backend name (splitserve.kv_transfer.CLUSTER_BACKENDS)
    lease_s: float  # how long exported KV waits for a decode worker to take it
    torch_threads: int | None = None  # torch intra-op threads; None: torch's default
    cpu_ids: tuple[int, ...] | None = None  # pin the worker's process to these cores (Linux)
    tp: TPInit | None = None  # this process's rank in the worker's TP group (None: TP=1)
    # hand a prompt's KV over layer by layer while its last prefill step computes it
    # (``PrefillWorker.prefill_stream``), where the backend can (KVSource.streams) and TP=1
    stream_kv: bool = False
    # bound on copying one prefix from another prefill worker (PrefillTask.prefix_from);
    # None: lease_s
    transfer_timeout_s: float | None = None


@dataclass(frozen=True)
class PrefillWorkerInfo:
    """What a router needs from a worker at start-up (and again after it restarted)."""

    worker_id: str
    validator: RequestValidator  # checks requests exactly as this worker's engine does
    handshakes: tuple[Handshake, ...]  # its KV sources', one per TP rank in rank order
    engine: str = ""  # what its engine chose (Engine.summary)
    streams_kv: bool = False  # prefill_stream hands KV over before prefill ends (layer-wise)
    kv_bytes_per_token: int = 0  # one token's KV in one rank's cache, all layers (docs/models.md)
    revision: str = ""  # which weights it serves (Engine.revision): KV moves only within one


@dataclass(frozen=True)
class PrefillTask:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeout_s: float | None = None  # past it the worker aborts the request (DeadlineExceeded)
    # the TP size of the decode worker that takes the KV: each of its ranks pulls its heads,
    # so an export's lease ends once every rank that reads it confirmed
    reader_tp: int = 1
    # the reader holds the prompt's first this many full blocks already (its own prefix
    # cache): only the blocks after them are exported, checksummed and moved
    export_from_block: int = 0
    # another prefill worker holds the prompt's leading blocks: take them from it rather
    # than compute them (the router judged the pull cheaper; ``PrefixPull``)
    prefix_from: PrefixPull | None = None


@dataclass(frozen=True)
class PrefixPull:
    """Where a prefill worker may take a prompt's leading full blocks from instead of
    computing them: ``holder``, another prefill worker, or a decode worker (a
    conversation's earlier turns end in its cache), whose prefix cache held the first
    ``num_blocks`` of them when the router last polled it. The borrower asks it for the
    blocks it lacks itself (``PrefixLender.lend_prefix``), pulls them over the transfer
    backend and verifies them; whatever fails on the way (the holder evicted them, died,
    or the pull failed) it computes them instead, and the request goes on."""

    holder: PrefixLender
    holder_id: str
    num_blocks: int


@dataclass(frozen=True)
class PrefixLoan:
    """A borrower asks a holder for its cached blocks ``from_block``.. of ``token_ids``
    (whole blocks: the prefix the borrower wants), exported under ``request_id`` and a
    lease until the borrower confirms them or ``abort(request_id)`` releases them."""

    request_id: str
    token_ids: list[int]
    from_block: int


@dataclass(frozen=True)
class PrefillResult:
    """A prefilled request: its first token and, unless the request already ended
    at that token, the ``KVHandoff`` of its KV (held under a lease until a decode
    worker confirms it, the lease ends, or ``abort`` releases it)."""

    request_id: str
    worker_id: str
    output_token_ids: list[int]  # the first sampled token
    text: str  # its text
    logprobs: list[float]
    token_time: float  # time.time() when it was sampled
    finish_reason: FinishReason | None  # set when the request ended at its first token
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    handoff: KVHandoff | None  # None when finish_reason is set
    scheduled_at: float | None = None  # time.time() when its engine began the prompt (queue time ends)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None  # when asked
    # prompt tokens whose KV it pulled from another prefill worker (task.prefix_from),
    # and from which; 0 and "" when it pulled none
    pulled_tokens: int = 0
    pulled_from: str = ""
    revision: str = ""  # the weights that prefilled it (Engine.revision)


@dataclass(frozen=True)
class PrefillAccepted:
    """The prefill worker took the request (its engine has it): from here a loss of the
    worker is a loss the request was present at; before it, the request never ran there
    (``PrefillUnreachable``)."""

    request_id: str


@dataclass(frozen=True)
class KVStreaming:
    """The prompt's KV has begun to stream (its last prefill step is running): a decode
    worker may pull ``handoff`` now; its layers become ready as the forward pass
    writes them, and the first token follows in the ``PrefillResult``."""

    request_id: str
    handoff: KVHandoff


# what a prefill worker's stream yields, in this order (``PrefillPeer.prefill_stream``)
PrefillEvent = PrefillAccepted | KVStreaming | PrefillResult


@dataclass(frozen=True)
class PrefillStats:
    worker_id: str
    engine: EngineStats
    exports: tuple[str, ...]  # request ids whose KV is exported and not yet taken (lease open)
    leases_confirmed: int  # exports ended by a decode worker's confirmation, since start
    leases_expired: int  # exports whose lease ran out unconfirmed
    leases_released: int  # exports given up (request cancelled or failed)
    prefix: PrefixUpdate | None = None  # its prefix cache's changes since the caller's cursor
    # prefixes pulled from other prefill workers (task.prefix_from): pulls that moved KV,
    # and those that failed or found nothing to take (the prompt was computed instead)
    prefix_pulls: int = 0
    prefix_pull_failures: int = 0


class PrefixLender(Protocol):
    """A worker whose cached prefixes others copy (a ``PrefillPeer``, or a decode
    worker's ``DecodePeer``): its handshakes (``info``), ``lend_prefix``, ``confirm``,
    ``abort``. Errors come back as splitserve's own (``WorkerLost`` for a lost worker)."""

    async def info(self) -> PrefillWorkerInfo: ...

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None: ...

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None: ...

    async def abort(self, request_id: str) -> bool: ...


class PrefillPeer(Protocol):
    """A prefill worker as its callers hold it: the router (a registry client), and a
    decode worker, which gets the same object in ``DecodeTask.source`` and prefills
    the request through it. Errors come back as splitserve's own (``WorkerLost`` for a
    lost worker)."""

    async def info(self) -> PrefillWorkerInfo: ...

    def prefill_stream(self, task: PrefillTask) -> AsyncIterator[PrefillEvent]:
        """``PrefillAccepted`` once the worker took the request, at most one
        ``KVStreaming``, then the ``PrefillResult``. Leaving early aborts the request on
        the worker (its export too)."""
        ...

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        """The decode side holds verified copies of these transfers: their leases end."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Stop the request wherever it is on the worker (its export's lease is released)."""
        ...

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        """Export the cached blocks ``loan`` asks for that the worker still holds, under a
        lease (the borrower confirms them, or ``abort(loan.request_id)`` lets them go);
        None when it holds none of them now."""
        ...
