"""The decode worker's ``Handover``, phase by phase, without Ray or an engine: a fake
decode side (which records what the engine holds and when a pull's bytes are still
landing) and the router tests' fake prefill worker as the source. Every failure path
of the handoff (``docs/reliability.md``) ends the request with its error, frees what
the phase held (after a pull in flight ended) and releases an unconfirmed export on
the source; a success frees nothing and confirms; the consumer always gets the
source's first token before the end."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Coroutine

import pytest

from splitserve.decode_worker.handover import _NEXT, Ending, Handover, Phase
from splitserve.decode_worker.outbox import Outbox
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeTask, DecodeWorkerSpec, TokenBatch
from splitserve.wire.errors import (
    DeadlineExceeded,
    KVTransferError,
    LeaseExpired,
    Overloaded,
    PeerLost,
    PrefillLost,
    PrefillUnreachable,
    WorkerLost,
)
from splitserve.wire.kv import Confirmation, KVHandoff
from splitserve.wire.sampling import SamplingParams
from tests.unit.router.fakes import FakePrefill, expected_tokens
from tests.waiting import until

PROMPT = list(range(1, 40))
SPEC = DecodeWorkerSpec("decode-0", EngineConfig(model="fake", block_size=16), "fake", 5.0, 8)
DEADLINE_S = 60  # a handover here takes milliseconds; one that hangs fails its test


class FakeSide:
    """A decode worker as a handover sees it. ``held`` is what its engine holds per
    request; a pull keeps ``landing`` set until it ends. ``fail`` names a step
    (``hold``, ``link``, ``admit``, ``pull``, ``activate``) and what it raises there;
    ``gate`` names a step that waits for ``release`` first."""

    def __init__(
        self,
        fail: dict[str, Exception] | None = None,
        gate: str | None = None,
        delivered: bool = False,
        outlast_lease: bool = False,
    ):
        self.spec = SPEC
        self.fail = fail or {}
        self.outlast_lease = outlast_lease
        self.gate = gate
        self.release = asyncio.Event()
        self.reached: set[str] = set()
        self.delivered = delivered
        self.held: dict[str, list[str]] = {}
        self.landing = False
        self.freed_while_landing = False
        self.activated: list[tuple[str, list[int]]] = []
        self.calls: list[asyncio.Task] = []

    async def _step(self, name: str) -> None:
        self.reached.add(name)
        if self.gate == name:
            await self.release.wait()
        if name in self.fail:
            raise self.fail[name]

    async def hold_prefix(self, task: DecodeTask) -> int:
        self.held[task.request_id] = ["cached"]
        await self._step("hold")
        return 16

    async def link(self, source, handoff: KVHandoff) -> None:
        await self._step("link")

    async def admit(self, task: DecodeTask, deadline, lease_s: float) -> list[int]:
        await self._step("admit")
        self.held[task.request_id].append("allocated")
        return [3, 4]

    async def pull(self, handoff: KVHandoff, blocks, timeout) -> tuple[list[Confirmation], float]:
        self.landing = True
        try:
            await self._step("pull")
            if self.outlast_lease:
                await until(lambda: handoff.remaining_lease() <= 0, "the lease to end")
        finally:
            self.landing = False
        descs = handoff.descriptors
        return [Confirmation(d.transfer_id, d.source_worker, self.delivered) for d in descs], 0.0

    async def verify(self, request_id: str, output_token_ids: list[int]) -> None:
        await self._step("verify")

    async def activate(self, request_id: str, output_token_ids: list[int], adapter_digest: str) -> None:
        await self._step("activate")
        self.activated.append((request_id, output_token_ids))

    def free(self, request_id: str) -> None:
        self.freed_while_landing |= self.landing
        self.held.pop(request_id, None)

    def background(self, call: Coroutine) -> None:
        self.calls.append(asyncio.ensure_future(call))


class ShortLease(FakePrefill):
    """A source whose exports' leases end ``lease_s`` after the export."""

    def __init__(self, *args, lease_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.lease_s = lease_s

    def _handoff(self, task):
        handoff = super()._handoff(task)
        desc = dataclasses.replace(handoff.descriptors[0], lease_expiry=time.time() + self.lease_s)
        return KVHandoff(handoff.source_worker, (desc,))


def _task(source, max_tokens=8, rid="r1") -> DecodeTask:
    return DecodeTask(rid, PROMPT, SamplingParams(max_tokens=max_tokens), source=source)


class Recording(Outbox):
    """An outbox that keeps every batch put, in order (``take`` merges them per request)."""

    def __init__(self):
        super().__init__("test")
        self.batches: list[TokenBatch] = []

    def put(self, batch: TokenBatch) -> None:
        self.batches.append(batch)


async def _run(side: FakeSide, source, task=None, cancel_at: str | None = None):
    """Run a handover to its end: (its result, its phase, the batches its consumer got).
    With ``cancel_at``, the handover is cancelled once it reached that (gated) step, as an
    abort or a deadline does, and the gate opens only after the cancel."""
    outbox = Recording()
    handover = Handover(task or _task(source), None, outbox, side)
    run = asyncio.ensure_future(handover.run())
    if cancel_at is not None:
        await until(lambda: cancel_at in side.reached, f"the handover to reach {cancel_at}")
        run.cancel()
        side.release.set()
        with pytest.raises(asyncio.CancelledError):
            await run
        result = "cancelled"
    else:
        result = await run
    await asyncio.gather(*side.calls)
    return result, handover.phase, outbox.batches


def _run_bounded(side: FakeSide, source, task=None, cancel_at: str | None = None):
    """``_run`` on a fresh event loop, within ``DEADLINE_S``: a handover that hangs fails
    its test."""
    return asyncio.run(asyncio.wait_for(_run(side, source, task, cancel_at), DEADLINE_S))


def test_the_transition_table_is_the_documented_chain():
    chain = [Phase.HOLDING]
    while _NEXT[chain[-1]] - {Phase.ENDED}:
        (step,) = _NEXT[chain[-1]] - {Phase.ENDED}
        chain.append(step)
    assert [p.name for p in chain] == [
        "HOLDING",
        "PREFILLING",
        "LINKING",
        "WAITING_FOR_BLOCKS",
        "PULLING",
        "ACTIVATING",
        "RUNNING",
    ]
    assert all(Phase.ENDED in _NEXT[p] for p in chain[:-1]) and not _NEXT[Phase.RUNNING] | _NEXT[Phase.ENDED]
    handover = Handover(_task(FakePrefill("prefill-0")), None, Outbox("o"), FakeSide())
    with pytest.raises(RuntimeError, match="HOLDING -> RUNNING"):
        handover._to(Phase.RUNNING)


@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("delivered", [False, True])
def test_a_handover_that_succeeds_runs_holding_what_it_pulled_and_confirms(streams, delivered):
    source, side = FakePrefill("prefill-0", streams=streams), FakeSide(delivered=delivered)
    ending, phase, batches = _run_bounded(side, source)
    first = expected_tokens(PROMPT, 1)
    assert ending is None and phase is Phase.RUNNING
    assert side.held == {"r1": ["cached", "allocated"]} and side.activated == [("r1", first)]
    assert source.aborted == [] and len(source.confirmed) == (0 if delivered else 1)
    assert source.calls[0].export_from_block == 1  # the one cached block stays here
    assert batches[0].token_ids == first and batches[0].prefilled is not None
    assert batches[0].prefilled.streamed is streams
    assert batches[1].token_ids == [] and batches[1].transfer_s is not None


@pytest.mark.parametrize("streams", [False, True])
def test_a_request_that_ends_at_its_first_token_frees_its_blocks_and_releases_nothing(streams):
    source, side = FakePrefill("prefill-0", streams=streams), FakeSide()
    ending, phase, batches = _run_bounded(side, source, _task(source, max_tokens=1))
    assert ending == Ending(None) and phase is Phase.ENDED
    assert side.held == {} and side.activated == [] and source.aborted == []
    assert [b.finish_reason for b in batches] == ["length"]
    # nothing was exported without a stream; a streamed export was pulled and confirmed
    assert side.reached == ({"hold", "link", "admit", "pull"} if streams else {"hold"})


def _lost(task):
    raise WorkerLost("the prefill worker died")


@pytest.mark.parametrize(
    "fail, step, error, released",
    [
        ({}, "prefill", PrefillLost, False),  # the source lost before any KV came
        ({"link": PeerLost("restarted since")}, "link", PeerLost, True),
        ({"admit": Overloaded("queue full")}, "admit", Overloaded, True),
        ({"admit": LeaseExpired("lease ended")}, "admit", LeaseExpired, True),
        ({"admit": DeadlineExceeded("deadline")}, "admit", DeadlineExceeded, True),
        ({"pull": KVTransferError("checksum")}, "pull", KVTransferError, True),
        ({"activate": WorkerLost("engine stopped")}, "activate", WorkerLost, False),
    ],
)
def test_each_failure_ends_the_request_frees_its_blocks_and_releases_an_unconfirmed_export(
    fail, step, error, released
):
    source = FakePrefill("prefill-0", fail=_lost if step == "prefill" else None)
    side = FakeSide(fail)
    ending, phase, batches = _run_bounded(side, source)
    assert isinstance(ending.error, error) and phase is Phase.ENDED
    assert side.held == {} and not side.freed_while_landing
    assert source.aborted == (["r1"] if released else [])
    if step != "prefill":  # the first token went out before the end
        assert batches[0].token_ids == expected_tokens(PROMPT, 1)


@pytest.mark.parametrize("took_it", [True, False])
def test_a_source_lost_before_it_took_the_request_is_unreachable_after_it_lost(took_it):
    """A prefill worker's loss before its ``PrefillAccepted`` (already dead: the request
    never ran there) is ``PrefillUnreachable``, which the router counts as no loss; after
    it, ``PrefillLost``."""
    source = FakePrefill("prefill-0", fail=_lost, takes=took_it)
    ending, phase, _ = _run_bounded(FakeSide(), source)
    assert isinstance(ending.error, PrefillLost) and phase is Phase.ENDED
    assert isinstance(ending.error, PrefillUnreachable) is not took_it


def test_a_source_lost_while_its_kv_streams_ends_the_request_after_the_pull_and_releases_it():
    source = FakePrefill("prefill-0", streams=True, fail=_lost)
    side = FakeSide({"pull": KVTransferError("the source went away mid-pull")})
    ending, phase, batches = _run_bounded(side, source)
    assert isinstance(ending.error, KVTransferError) and phase is Phase.ENDED
    assert side.held == {} and not side.freed_while_landing and source.aborted == ["r1"]
    assert batches == []  # the source never sent a first token


def test_a_source_lost_after_every_layer_was_pulled_ends_the_request_with_peer_lost():
    """The pull had the whole KV (confirmed: the export is not released), but the
    source's result never comes: ACTIVATING ends with ``PeerLost``, blocks freed."""
    source, side = FakePrefill("prefill-0", streams=True, fail=_lost), FakeSide()
    ending, phase, batches = _run_bounded(side, source)
    assert isinstance(ending.error, PeerLost) and phase is Phase.ENDED
    assert side.held == {} and side.activated == [] and batches == []
    assert source.aborted == [] and len(source.confirmed) == 1


def test_a_lease_that_ends_during_the_pull_fails_it_as_expired():
    source, side = ShortLease("prefill-0", lease_s=0.3), FakeSide(outlast_lease=True)
    ending, phase, _ = _run_bounded(side, source)
    assert isinstance(ending.error, LeaseExpired) and phase is Phase.ENDED
    assert side.held == {} and source.aborted == ["r1"] and source.confirmed == []


def test_the_first_token_goes_out_before_a_failure_that_came_first():
    """A streaming source's link fails at once; its result comes later: the consumer
    gets that first token, and the request ends only after it."""
    source = FakePrefill("prefill-0", streams=True, delay_s=0.2)
    side = FakeSide({"link": PeerLost("gone")})
    ending, _, batches = _run_bounded(side, source)
    assert isinstance(ending.error, PeerLost)
    assert [b.token_ids for b in batches] == [expected_tokens(PROMPT, 1)]


@pytest.mark.parametrize(
    "step, released", [("hold", False), ("link", True), ("admit", True), ("pull", True), ("activate", False)]
)
def test_a_cancelled_handover_frees_what_its_phase_held_after_the_pull_ended(step, released):
    """An abort or a deadline cancels the handover at each step: the blocks are freed
    (never while a pull's bytes are landing) and an unconfirmed export released."""
    source, side = FakePrefill("prefill-0"), FakeSide(gate=step)
    result, phase, _ = _run_bounded(side, source, cancel_at=step)
    assert result == "cancelled" and phase is Phase.ENDED
    assert side.held == {} and not side.freed_while_landing
    assert source.aborted == (["r1"] if released else [])
