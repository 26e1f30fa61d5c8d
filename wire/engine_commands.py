"""What a worker asks of its engine, one record per operation: the engine runs it on
its own thread (``EngineLoop.submit``, ``engine.commands.run``) and the caller gets
its result or its error. Plain data (no torch, no callables), so the same records
could cross a pipe to an engine in a process of its own.

Each record names the ``Engine`` method it runs; that method's docstring is its
contract (what it holds, frees and raises). The records that lend KV to another
worker (``MoveOut``, ``LendRunning``, ``LendPrefix``, and ``Abort`` of a lent
request) also name the lender: the worker's KV source, which exports what the
engine holds for it under a lease (``engine.commands.Lender``), by the name the
worker gave it on its loop (``EngineLoop.add_lender``; one engine may serve two:
an elastic worker's halves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.wire.decode import RunningLoan
from splitserve.wire.faults import HandoffFault
from splitserve.wire.prefill import PrefixLoan
from splitserve.wire.prefix import PrefixCursor
from splitserve.wire.sampling import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """``Engine.add_request`` with token ids; with ``adopt`` (loan id, blocks), the
    blocks a prefix borrow filled are adopted into the cache first, in the same call,
    so the prompt finds them cached (``Engine.adopt_prefix``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    prefill_only: bool = False
    export_from_block: int = 0
    adopt: tuple[str, int] | None = None


@dataclass(frozen=True)
class Abort:
    """``Engine.abort``: True if the request was there. With ``lender``, first its export
    there, if one is open: released (``Lender.release``), True."""

    request_id: str
    lender: str | None = None


@dataclass(frozen=True)
class HoldPrefix:
    """``Engine.hold_prefix``: the tokens of the prompt's cached leading blocks, held."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class ImportRequest:
    """``Engine.import_request``: the block ids to pull the rest of the KV into."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Activate:
    """``Engine.activate``: an imported request, its KV in place, joins the batch; with
    ``adapter_digest`` (the source's ``KVHandoff.adapter_digest``) once it is the KV of
    the LoRA adapter the request runs under here."""

    request_id: str
    output_token_ids: list[int]
    adapter_digest: str | None = None


@dataclass(frozen=True)
class LoadAdapter:
    """``Engine.load_adapter``: serve LoRA adapter ``name`` from ``path``; its digest."""

    name: str
    path: str


@dataclass(frozen=True)
class UnloadAdapter:
    """``Engine.unload_adapter``: serve LoRA adapter ``name`` to no new request."""

    name: str


@dataclass(frozen=True)
class VerifyImport:
    """``Engine.verify_import``: an imported request's KV, in place, checked by meaning
    (``engine.meaning``) before it is activated."""

    request_id: str
    output_token_ids: list[int]


@dataclass(frozen=True)
class InjectFault:
    """``Engine.inject_fault``: a harness's fault (``wire.faults``) in an imported
    request's KV, before its check."""

    request_id: str
    fault: HandoffFault


@dataclass(frozen=True)
class ReserveMoving:
    """``Engine.reserve_moving``: (blocks held, blocks to fill) ahead of a move."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class FillMoving:
    """``Engine.fill_moving``: the first ``num_blocks`` reserved blocks hold their KV,
    computed under ``adapter_digest`` (the loan's ``KVHandoff.adapter_digest``)."""

    request_id: str
    num_blocks: int
    adapter_digest: str | None = None


@dataclass(frozen=True)
class ReservePrefix:
    """``Engine.reserve_prefix``: (blocks held, blocks to fill) for a borrowed prefix."""

    loan_id: str
    token_ids: list[int]


@dataclass(frozen=True)
class Withdraw:
    """``Engine.withdraw``: a running request's output tokens, its blocks freed."""

    request_id: str


@dataclass(frozen=True)
class MeasureRates:
    """``Engine.measure_rates`` on a prompt of ``num_tokens``."""

    num_tokens: int


@dataclass(frozen=True)
class Snapshot:
    """``(Engine.stats(), Engine.prefix_update(prefix_since), leases)``, taken together;
    ``leases``: ``lender``'s (``Lender.leases``), None without one."""

    prefix_since: PrefixCursor | None = None
    lender: str | None = None


@dataclass(frozen=True)
class MoveOut:
    """``Engine.suspend`` (a running request stops here, its KV after its first
    ``from_block`` blocks held), then those blocks lent by ``lender``: a
    ``MovedRequest``."""

    request_id: str
    from_block: int
    lender: str


@dataclass(frozen=True)
class LendRunning:
    """``Engine.lend_running`` (a running request's full blocks held under the loan's id
    while it decodes on), lent by ``lender``: a ``KVHandoff``, or None where it holds
    none past ``loan.from_block``."""

    loan: RunningLoan
    lender: str


@dataclass(frozen=True)
class LendPrefix:
    """``Engine.lend_prefix`` (the cached blocks of ``loan.token_ids`` held), lent by
    ``lender``: a ``KVHandoff``, or None where the cache holds none of them."""

    loan: PrefixLoan
    lender: str


EngineCommand = (
    AddRequest
    | Abort
    | HoldPrefix
    | ImportRequest
    | VerifyImport
    | InjectFault
    | Activate
    | LoadAdapter
    | UnloadAdapter
    | ReserveMoving
    | FillMoving
    | ReservePrefix
    | Withdraw
    | MeasureRates
    | Snapshot
    | MoveOut
    | LendRunning
    | LendPrefix
)
