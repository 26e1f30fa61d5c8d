"""What crosses the boundary of a decode worker: typed records, no tuples or dicts.
Plain data: importing this module loads no torch (a router unpickles these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import SplitserveError
from splitserve.wire.kv import DEFAULT_LEASE_S, Confirmation, Handshake, KVDescriptor, KVHandoff
from splitserve.wire.outputs import EngineStats, PromptLogprob, RequestOutput, TopLogprobs
from splitserve.wire.prefill import PrefillPeer, PrefixLoan, PrefixPull
from splitserve.wire.prefix import PrefixUpdate
from splitserve.wire.sampling import FinishReason, SamplingParams
from splitserve.wire.tp import TPInit
from splitserve.wire.validation import RequestValidator


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
    tp: TPInit | None = None  # this process's rank in the worker's TP group (None: TP=1)
    # how long the KV of a request it moved away stays held for the taker (live migration)
    lease_s: float = DEFAULT_LEASE_S
    # the share of the KV it takes in (a handoff, a move) checked by meaning before the
    # request runs (``engine.meaning``): 0 never, 1 always
    verify_meaning: float = 0.0
    # run the engine in a process of its own (``engine.process``): colocated, TP and EP 1 only
    engine_process: bool = False


class DecodeRankPeer(Protocol):
    """Rank r > 0 of a decode worker's TP group as rank 0 holds it (a Ray client in a
    cluster, the ``DecodeRank`` itself where both share a process's event loop).
    ``decode_worker.tp`` describes the protocol; errors come back as splitserve's own
    (``WorkerLost`` for a lost rank)."""

    async def link(self, handshakes: tuple[Handshake, ...]) -> None:
        """Link the rank to a source group (its handshakes in rank order)."""
        ...

    async def pull(
        self, descriptors: tuple[KVDescriptor, ...], blocks: list[int], timeout: float
    ) -> tuple[list[Confirmation], float]:
        """Pull the rank's KV heads of one request into ``blocks`` (the rank's own block
        ids); its confirmations, and the seconds it waited for a streamed source's layers."""
        ...


@dataclass(frozen=True)
class DecodeWorkerInfo:
    worker_id: str
    validator: RequestValidator
    colocated: bool  # prefills every request itself (no KV transfer backend)
    engine: str = ""  # what its engine chose (Engine.summary)
    kv_bytes_per_token: int = 0  # one token's KV in one rank's cache, all layers (docs/models.md)
    revision: str = ""  # which weights it serves (Engine.revision): KV moves only within one
    # the KV source its running requests move away through (live migration; empty: it
    # cannot move them, e.g. a TP group or a colocated worker: they move by recompute)
    handshakes: tuple[Handshake, ...] = ()


@dataclass(frozen=True)
class DecodeTask:
    """One request for a decode worker.

    With ``source`` set, that prefill worker prefills it: the decode worker sends
    it the prompt itself (``PrefillPeer.prefill_stream``), passes the first token
    on as soon as it comes, links to the source if it has not yet (its
    handshakes, by ``source.info``), pulls the KV (layer by layer while the
    source computes it, where it streams), confirms the transfer to the source,
    and decodes from there. With ``moved`` it takes over a running request from
    another decode worker (``moved_from``), pulling its KV and decoding on after
    its tokens. Without either, the worker prefills ``prompt_token_ids``
    and ``output_token_ids`` (tokens already sent, when a request resumes after a
    lost worker or a failed transfer) itself, and continues after them as the
    undisturbed run would (the same seeded stream; ``max_tokens`` counts them)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeout_s: float | None = None  # past it the worker aborts the request (DeadlineExceeded)
    output_token_ids: list[int] = field(default_factory=list)  # only without a source
    source: PrefillPeer | None = None
    prefix_from: PrefixPull | None = None  # with a source: passed on to it (PrefillTask.prefix_from)
    # a running request another decode worker suspended and exported (live migration): its
    # KV is pulled from ``moved_from`` (decode_worker.migration), no token is computed again
    moved: MovedRequest | None = None
    moved_from: DecodePeer | None = None


@dataclass(frozen=True)
class MovedRequest:
    """A running request a decode worker let go of for another to take over (live
    migration): the KV of its prompt and of every token but the last, exported under a
    lease as a prefill's is (the taker confirms it, or ``abort`` releases it), and every
    token it generated there; they are never sent again. ``handoff`` None: it moves by
    recompute (its KV was freed; the taker prefills the prompt and those tokens)."""

    request_id: str
    worker_id: str  # the decode worker it moved from
    handoff: KVHandoff | None
    output_token_ids: list[int]
    revision: str  # the weights that generated them (Engine.revision)


@dataclass(frozen=True)
class PreCopy:
    """Before running request ``request_id`` moves to a decode worker from ``holder``
    (live migration), that worker copies the KV of its full blocks so far while it still
    decodes there (``DecodeWorker.precopy``), so that the move itself copies only the
    blocks after them. ``output_token_ids``: the tokens it generated so far (at least
    those passed on to the client; those the holder made since come with the move)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    holder: DecodePeer
    holder_id: str
    timeout_s: float  # bounds the copy (the loan, the link and the pull)


@dataclass(frozen=True)
class RunningLoan:
    """A pre-copy asks the decode worker a request runs on for the full blocks of its KV
    from ``from_block`` on, at most those of ``token_ids`` (whole blocks: the request's
    tokens as the taker knows them), exported under ``loan_id`` and a lease until the
    taker confirms them or ``abort(loan_id)`` releases them."""

    loan_id: str
    request_id: str
    token_ids: list[int]
    from_block: int


class DecodePeer(Protocol):
    """A decode worker as another decode worker sees it, to take over a request it moved
    away (``DecodeTask.moved_from``), copy one's KV before the move (``PreCopy``), or copy
    a cached prefix (``PrefixPull``): its handshakes (``info``), ``lend_running``,
    ``lend_prefix``, ``confirm``, ``abort``. Errors come back as
    splitserve's own (``WorkerLost`` for a lost worker)."""

    async def info(self) -> DecodeWorkerInfo: ...

    async def lend_running(self, loan: RunningLoan) -> KVHandoff | None:
        """Export a running request's full blocks as ``loan`` asks, under a lease; None
        when it has none past ``loan.from_block``."""
        ...

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        """Export the cached blocks of ``loan`` (a conversation's earlier turns, for a
        prefill worker computing its next) under a lease; None when it holds none."""
        ...

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        """The taker holds verified copies of these transfers: their leases end."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Release the request's export (and anything else it holds there)."""
        ...


@dataclass(frozen=True)
class Prefilled:
    """How a prefill worker prefilled a request: on the batch with its first token."""

    worker_id: str
    scheduled_at: float | None  # time.time() when its engine began the prompt (its clock)
    exported_at: float | None  # time.time() when its handoff reached the decode worker (None: no KV)
    streamed: bool  # the KV streamed layer by layer while the prompt's last step ran
    kv_bytes: int  # the handoff's size (0: the request ended at its first token)
    pulled_tokens: int = 0  # prompt tokens whose KV the prefill worker pulled from another
    pulled_from: str = ""  # that other prefill worker
    revision: str = ""  # the weights that prefilled it (its Engine.revision)


@dataclass(frozen=True)
class TokenBatch:
    """New tokens of one request since the previous batch (coalesced when the
    consumer is slower than the decode steps). The last batch of a request has
    ``finish_reason`` or ``error``.

    For a request prefilled on a prefill worker, the batch with the first token
    carries ``prefilled``, and a batch with no tokens follows the pull with its
    ``transfer_s`` (both may come merged into one)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float]
    token_times: list[float]  # time.time() at which each token was sampled
    finish_reason: FinishReason | None
    num_cached_tokens: int
    # after an imported request's pull: its seconds (less, streamed, its waits for layers)
    transfer_s: float | None = None
    prefilled: Prefilled | None = None  # on the batch with the first token from a prefill worker
    error: SplitserveError | None = None  # the request ended here with this error (tokens before it stand)
    # time.time() when this worker took the request into its batch: for an imported
    # request when its KV had landed (on the pull's batch), else when its engine began
    # the prompt; on every batch from then on
    started_at: float | None = None
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per token, when asked
    prompt_logprobs: list[PromptLogprob] | None = None  # on the batch with the first token, when asked
    # the request left this worker for another (live migration) after these tokens: its
    # last batch here, neither finished nor failed
    moved: bool = False
    # speculative decoding of the request on this worker so far: tokens proposed, kept
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @classmethod
    def of_output(cls, out: RequestOutput, now: float) -> TokenBatch:
        """An engine step's news of one request, sampled at ``now`` (``time.time()``)."""
        return cls(
            request_id=out.request_id,
            token_ids=list(out.new_token_ids),
            text=out.text,
            logprobs=list(out.new_logprobs),
            top_logprobs=list(out.new_top_logprobs),
            prompt_logprobs=out.prompt_logprobs,
            token_times=[now] * len(out.new_token_ids),
            finish_reason=out.finish_reason if out.finished else None,
            num_cached_tokens=out.num_cached_tokens,
            started_at=out.scheduled_at,
            error=out.error,
            draft_tokens=out.draft_tokens,
            accepted_draft_tokens=out.accepted_draft_tokens,
        )

    @classmethod
    def moved_away(cls, request_id: str) -> TokenBatch:
        """The last batch of a request that moved to another decode worker from here."""
        return cls(request_id, [], "", [], [], None, 0, moved=True)

    @classmethod
    def failure(cls, request_id: str, error: SplitserveError) -> TokenBatch:
        """The last batch of a request that ended here with ``error``."""
        return cls(request_id, [], "", [], [], None, 0, error=error)


@dataclass(frozen=True)
class DecodeStats:
    worker_id: str
    engine: EngineStats
    num_waiting_for_blocks: int  # imported requests queued for KV blocks (FIFO)
    num_pulling: int  # imported requests whose KV is moving in
    prefix: PrefixUpdate | None = None  # its prefix cache's changes since the caller's cursor
    # prefill worker id -> the source incarnations whose handshakes it holds (one per TP rank)
    peers: dict[str, tuple[str, ...]] = field(default_factory=dict)


def merge(batches: list[TokenBatch]) -> TokenBatch:
    """Consecutive batches of one request as one (tokens in order; the last word on how
    it ended; the pull's figures from whichever batch carried them)."""
    if len(batches) == 1:
        return batches[0]
    last = batches[-1]
    transfer = [b for b in batches if b.transfer_s is not None]
    return TokenBatch(
        request_id=last.request_id,
        token_ids=[t for b in batches for t in b.token_ids],
        text="".join(b.text for b in batches),
        logprobs=[x for b in batches for x in b.logprobs],
        top_logprobs=[x for b in batches for x in b.top_logprobs],
        prompt_logprobs=next((b.prompt_logprobs for b in batches if b.prompt_logprobs is not None), None),
        token_times=[t for b in batches for t in b.token_times],
        finish_reason=last.finish_reason,
        num_cached_tokens=max(b.num_cached_tokens for b in batches),
        transfer_s=transfer[0].transfer_s if transfer else None,
        prefilled=next((b.prefilled for b in batches if b.prefilled is not None), None),
        error=last.error,
        started_at=next((b.started_at for b in batches if b.started_at is not None), None),
        moved=last.moved,
        draft_tokens=max(b.draft_tokens for b in batches),
        accepted_draft_tokens=max(b.accepted_draft_tokens for b in batches),
    )
