"""One imported request's way into a decode worker's batch, as a state machine.

A decode worker runs one ``Handover`` per request whose task names a source (a
prefill worker), as a task of its own: the request is prefilled on the source,
its first token passed on to the consumer at once, the source's handshakes
linked, blocks found in the admission queue, the KV pulled and verified, the
transfer confirmed, and the request activated in the engine's batch. The phases,
and what each holds (``Phase``)::

    phase               entered when                              holds here           on the source
    HOLDING             the handover starts                       (taking the cached   -
                                                                  leading blocks)
    PREFILLING          the prompt's cached leading blocks are    the cached blocks    the prefill
                        held (hold_prefix)
    LINKING             the source's first event came with a      the cached blocks    the export,
                        handoff (KVStreaming, or a PrefillResult)                      unconfirmed
    WAITING_FOR_BLOCKS  this worker holds the source's handshakes the cached blocks    the export
    PULLING             the admission queue allocated the rest's  all the blocks;      the export
                        blocks; the pull began                    bytes landing
    ACTIVATING          the pull ended whole within the lease;    all the blocks       nothing
                        the confirmations are sent                                     (confirmed)
    RUNNING             the source's result came; the engine      (the engine's        nothing
                        activated the request                     request)
    ENDED               any end before RUNNING                    nothing              nothing

The transitions (``_NEXT``; any other raises, being a bug)::

    HOLDING -> PREFILLING -> LINKING -> WAITING_FOR_BLOCKS -> PULLING -> ACTIVATING -> RUNNING
    any phase but RUNNING -> ENDED

An end before RUNNING, whatever caused it (an error in a phase; the request
cancelled by an abort or its deadline; the request ended at its first token),
frees what the phase held, in this order, and nobody else frees it:

1. a pull in flight is awaited (its bytes are still landing in the blocks; it is
   bounded by the worker's ``transfer_timeout_s``);
2. the engine frees the request's blocks, the cached ones and the allocated ones
   (``DecodeSide.free``);
3. an export not confirmed (LINKING to PULLING) is released on the source
   (``source.abort``, not awaited): no KV block stays held there.

(The export's pull is a ``kv_transfer.leased_pull.LeasedPull``, the one way KV
comes in, which keeps this order for every caller.)

The consumer always gets the source's first token first, once the source sends
it: a failure after the handoff waits for it before the request ends. ``run``
returns what the request ends with, for the worker to pass on (``Ending``).

The failure paths, each with its phase and the error the consumer gets (under
``transfer.on_failure: recompute`` the router recomputes after a transfer error):

- the source is lost before any KV came (PREFILLING): ``PrefillLost``, or
  ``PrefillUnreachable`` before it took the request (no ``PrefillAccepted`` came);
- the source is lost while its KV streams: its pull fails (PULLING,
  ``KVTransferError``), or, every layer pulled, its result never comes
  (ACTIVATING, ``PeerLost``);
- the source is gone, or restarted since it exported (LINKING): ``PeerLost``;
- the admission queue is full, no blocks came within the lease, the lease had
  ended, or the deadline came (WAITING_FOR_BLOCKS): ``Overloaded``,
  ``LeaseExpired``, ``DeadlineExceeded``;
- the pull fails (corrupt bytes, a timeout, the source gone) (PULLING):
  ``KVTransferError``; the lease ended during the pull: ``LeaseExpired``;
- the request is aborted, or its deadline passes, in any phase: cancelled.

Lives on the worker's event loop; imports no Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Protocol

from splitserve.decode_worker.outbox import Outbox
from splitserve.kv_transfer.leased_pull import LeasedPull, Pulled
from splitserve.wire.decode import DecodePeer, DecodeTask, DecodeWorkerSpec, Prefilled, TokenBatch
from splitserve.wire.errors import PeerLost, PrefillLost, PrefillUnreachable, WorkerLost
from splitserve.wire.kv import Confirmation, KVHandoff
from splitserve.wire.prefill import (
    PrefillAccepted,
    PrefillEvent,
    PrefillPeer,
    PrefillResult,
    PrefillTask,
)


class Phase(enum.Enum):
    HOLDING = "holding"
    PREFILLING = "prefilling"
    LINKING = "linking"
    WAITING_FOR_BLOCKS = "waiting_for_blocks"
    PULLING = "pulling"
    ACTIVATING = "activating"
    RUNNING = "running"
    ENDED = "ended"


def transitions(order: tuple[Phase, ...]) -> dict[Phase, frozenset[Phase]]:
    """Each phase of ``order`` (ending with RUNNING) to the next one or ENDED; RUNNING
    and ENDED to none."""
    return {
        **{a: frozenset({b, Phase.ENDED}) for a, b in zip(order, order[1:], strict=False)},
        Phase.RUNNING: frozenset(),
        Phase.ENDED: frozenset(),
    }


_NEXT = transitions(
    (
        Phase.HOLDING,
        Phase.PREFILLING,
        Phase.LINKING,
        Phase.WAITING_FOR_BLOCKS,
        Phase.PULLING,
        Phase.ACTIVATING,
        Phase.RUNNING,
    )
)


class DecodeSide(Protocol):
    """What a handover asks of the decode worker it runs on (``DecodeWorker``'s, or a
    fake in tests); its ``link`` and ``pull`` are the ``Puller`` its leased pull runs
    on. Every call is made on the worker's event loop."""

    spec: DecodeWorkerSpec

    async def hold_prefix(self, task: DecodeTask) -> int:
        """Hold the prompt's leading full blocks the engine has cached; the tokens held."""

    async def admit(self, task: DecodeTask, deadline: float | None, lease_s: float) -> list[int]:
        """Wait in the admission queue for the rest's blocks (allocated to the request)."""

    async def link(self, source: PrefillPeer | DecodePeer, handoff: KVHandoff) -> None:
        """Hold the handshakes of ``handoff``'s source incarnations; ``PeerLost`` if gone."""

    async def pull(
        self, handoff: KVHandoff, blocks: list[int], timeout: float
    ) -> tuple[list[Confirmation], float]:
        """Pull and verify the KV into ``blocks``: the confirmations, and the seconds waited
        for a streamed source's layers. Returns or raises only once no byte is landing."""

    async def verify(self, request_id: str, output_token_ids: list[int]) -> None:
        """Check the pulled KV by meaning (``engine.meaning``), where the worker does."""
        ...

    async def activate(self, request_id: str, output_token_ids: list[int], adapter_digest: str) -> None:
        """Put the request, its KV in place, into the engine's decode batch: ``AdapterMismatch``
        unless ``adapter_digest`` (``KVHandoff.adapter_digest``) is its LoRA adapter's here."""

    def free(self, request_id: str) -> None:
        """Free the request's blocks in the engine (not awaited; idempotent)."""

    def background(self, call: Coroutine) -> None:
        """Run a call to a source without awaiting it (its failure is logged)."""


@dataclass(frozen=True)
class Ending:
    """How a handover that did not reach RUNNING ends its request: with ``error``, or,
    when None, as the consumer already knows (the request ended at its first token)."""

    error: Exception | None


class WayIn:
    """What a request's way into this worker's batch with KV from elsewhere (a
    ``Handover``, a ``decode_worker.migration.Migration``) is made of: its phases, from
    ``first`` along ``allowed`` (a ``transitions`` table; any other step is a bug and
    raises ``RuntimeError``), the export's leased pull from
    LINKING to ACTIVATING, and its end, which frees what the phase held."""

    def __init__(
        self,
        task: DecodeTask,
        deadline: float | None,
        outbox: Outbox,
        side: DecodeSide,
        first: Phase,
        allowed: dict[Phase, frozenset[Phase]],
    ):
        """``deadline``: the request's, in ``time.monotonic()``, or None."""
        self.task = task
        self.request_id = task.request_id
        self._deadline = deadline
        self._outbox = outbox
        self._side = side
        self._phase = first
        self._allowed = allowed
        self._lease: LeasedPull | None = None  # the export's pull, from LINKING on
        self._adapter_digest = ""  # the LoRA adapter the KV pulled was computed under

    @property
    def phase(self) -> Phase:
        return self._phase

    async def _pull_in(self, lender: PrefillPeer | DecodePeer, handoff: KVHandoff) -> Pulled:
        """LINKING to ACTIVATING: the export ``lender`` holds, pulled into blocks from the
        admission queue, verified and confirmed."""
        side, rid = self._side, self.request_id
        what = f"moved request {rid}" if self.task.moved is not None else f"request {rid}"
        self._lease = LeasedPull(side, lender, rid, side.background, what)
        self._adapter_digest = handoff.adapter_digest
        await self._lease.link(handoff)
        self._to(Phase.WAITING_FOR_BLOCKS)
        blocks = await side.admit(self.task, self._deadline, handoff.remaining_lease())
        self._to(Phase.PULLING)
        pulled = await self._lease.pull(handoff, blocks, pull_timeout(side.spec, self._deadline))
        self._to(Phase.ACTIVATING)
        return pulled

    async def _activate(self, pulled_s: float, output_token_ids: list[int]) -> None:
        """ACTIVATING to RUNNING, the KV checked by meaning first where the worker does (a
        mismatch raises ``MeaningMismatch``: the pull failed). The pull's time and when this
        worker took the request into its batch are reported next, so that they reach the
        consumer before any token."""
        await self._side.verify(self.request_id, output_token_ids)
        self._outbox.put(
            TokenBatch(self.request_id, [], "", [], [], None, 0, pulled_s, started_at=time.time())
        )
        await self._side.activate(self.request_id, output_token_ids, self._adapter_digest)
        self._to(Phase.RUNNING)

    async def _end(self) -> None:
        """ENDED, freeing what the phase held: the blocks in the engine, after a pull in
        flight ended, and an export not yet confirmed released on the worker holding it
        (``LeasedPull.end``'s order; before LINKING, the blocks alone)."""
        rid = self.request_id
        if self._lease is None:
            self._side.free(rid)
        else:
            await self._lease.end(lambda: self._side.free(rid))
        self._to(Phase.ENDED)

    def _to(self, phase: Phase) -> None:
        if phase not in self._allowed[self._phase]:
            raise RuntimeError(
                f"{type(self).__name__.lower()} of {self.request_id}: "
                f"no transition {self._phase.name} -> {phase.name}"
            )
        self._phase = phase


class Handover(WayIn):
    """One imported request from its start to RUNNING or ENDED. The worker makes it when
    it accepts the task and runs ``run`` as a task; cancelling that task (abort,
    deadline) ends the handover, freeing what its phase held."""

    def __init__(self, task: DecodeTask, deadline: float | None, outbox: Outbox, side: DecodeSide):
        """``deadline``: the request's, in ``time.monotonic()``, or None."""
        if task.source is None:
            raise ValueError("a handover takes a request from a source")
        super().__init__(task, deadline, outbox, side, Phase.HOLDING, _NEXT)
        self._first: asyncio.Future[PrefillResult] | None = None  # the source's result, once on its way

    async def run(self) -> Ending | None:
        """Take the request over: None once it is RUNNING; else, ENDED, how it ends (its
        blocks freed and its export released already). Cancelled, it ends the handover
        and raises ``CancelledError``."""
        try:
            result = await self._take_over()
            if result is not None and result.finish_reason is None:
                await self._activate(self._pulled_s, result.output_token_ids)
                return None
            ending = Ending(None)  # it ended at its first token: the consumer has that end
        except asyncio.CancelledError:
            await self._end()
            raise
        except Exception as e:
            ending = Ending(None if _ended_at_first_token(self._first) else e)
        await self._end()
        return ending

    # ---- the phases ------------------------------------------------------------
    async def _take_over(self) -> PrefillResult | None:
        """HOLDING to ACTIVATING: the source's result once the KV is here and confirmed;
        or None, the request having ended at its first token with nothing exported."""
        task, side = self.task, self._side
        held = await side.hold_prefix(task)
        self._to(Phase.PREFILLING)
        left = None if self._deadline is None else max(0.001, self._deadline - time.monotonic())
        prefill = PrefillTask(
            self.request_id,
            task.prompt_token_ids,
            task.params,
            left,
            # the source maps KV heads to a group of tp_size readers (under EP one rank reads it all)
            reader_tp=side.spec.engine.tp_size,
            export_from_block=held // side.spec.engine.block_size,  # the cached blocks stay held here
            prefix_from=task.prefix_from,
        )
        async with contextlib.aclosing(task.source.prefill_stream(prefill)) as events:
            try:
                return await self._hand_over(events)
            except Exception:
                if self._first is not None:  # its first token, when it comes, goes out first
                    await asyncio.wait([self._first])
                raise
            finally:
                if self._first is not None and not self._first.done():
                    self._first.cancel()  # before the stream it reads closes
                    await asyncio.wait([self._first])

    async def _hand_over(self, events) -> PrefillResult | None:
        first = await _prefill_event(events, self.request_id, kv_began=False, accepted=False)
        if isinstance(first, PrefillAccepted):
            first = await _prefill_event(events, self.request_id, kv_began=False)
        handoff, exported_at = first.handoff, time.time()
        if isinstance(first, PrefillResult):
            self._pass_on(first, exported_at, streamed=False)
            self._first = asyncio.get_running_loop().create_future()
            self._first.set_result(first)
        else:
            self._first = asyncio.ensure_future(self._first_token(events, handoff, exported_at))
        if handoff is None:  # it ended at its first token: nothing was exported
            return None
        self._to(Phase.LINKING)
        pulled = await self._pull_in(self.task.source, handoff)
        self._pulled_s = pulled.pulled_s - pulled.waited_s  # not the time the source took to compute
        return await self._first

    # ---- the source's first token --------------------------------------------------
    async def _first_token(self, events, handoff: KVHandoff, exported_at: float) -> PrefillResult:
        """A streaming source's result, after its handoff: its first token goes out now."""
        result = await _prefill_event(events, self.request_id, kv_began=True)
        self._pass_on(result, exported_at, streamed=True, handoff=handoff)
        return result

    def _pass_on(
        self, result: PrefillResult, exported_at: float, streamed: bool, handoff: KVHandoff | None = None
    ) -> None:
        """The source's first token (and the end, if the request ended at it), to the consumer now."""
        handoff = handoff or result.handoff
        prefilled = Prefilled(
            result.worker_id,
            result.scheduled_at,
            exported_at if handoff is not None else None,
            streamed,
            handoff.num_bytes if handoff is not None else 0,
            result.pulled_tokens,
            result.pulled_from,
            result.revision,
        )
        n = len(result.output_token_ids)
        self._outbox.put(
            TokenBatch(
                self.request_id,
                list(result.output_token_ids),
                result.text,
                list(result.logprobs),
                [result.token_time] * n,
                result.finish_reason,
                result.num_cached_tokens,
                prefilled=prefilled,
                top_logprobs=list(result.top_logprobs),
                prompt_logprobs=result.prompt_logprobs,
            )
        )


def pull_timeout(spec: DecodeWorkerSpec, deadline: float | None) -> float:
    """How long a pull may take: the worker's ``transfer_timeout_s``, within the request's
    ``deadline`` (``time.monotonic()``; None: none)."""
    if deadline is None:
        return spec.transfer_timeout_s
    return max(0.001, min(spec.transfer_timeout_s, deadline - time.monotonic()))


async def _prefill_event(events, rid: str, kv_began: bool, accepted: bool = True) -> PrefillEvent:
    """The source's next event. Lost (or its stream ended early) before any KV came,
    ``PrefillLost`` (``PrefillUnreachable`` unless it had ``accepted`` the request);
    after, ``PeerLost`` (the KV will not be whole)."""
    try:
        item = await anext(events, None)
    except WorkerLost as e:
        item, why = None, str(e)
    else:
        why = "it ended its stream without a result"
    if item is None or (kv_began and not isinstance(item, PrefillResult)):
        if kv_began:
            raise PeerLost(f"the prefill worker of request {rid} was lost while its KV streamed: {why}")
        if not accepted:
            raise PrefillUnreachable(f"the prefill worker of request {rid} was lost before it took it: {why}")
        raise PrefillLost(f"the prefill worker of request {rid} was lost before its KV came: {why}")
    return item


def _ended_at_first_token(first: asyncio.Future | None) -> bool:
    """Whether the source's result came and ended the request (its exception, if any,
    is retrieved here)."""
    if first is None or not first.done() or first.cancelled() or first.exception() is not None:
        return False
    return first.result().finish_reason is not None
