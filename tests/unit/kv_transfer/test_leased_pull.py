"""The one leased pull (``kv_transfer.leased_pull``) as each of its four callers uses
it: a prefilled request's ``Handover``, a live ``Migration``, a ``PreCopier`` copy and
a ``PrefixBorrower`` borrow, with a fake puller and the router tests' fake worker as
the lender (no engine, no transfer). Each failure path of the pull (the lender lost
at link, the lease ended during the pull, corrupt bytes, the caller cancelled while
bytes land) ends the caller's work as that caller documents (an error for the
request, or a copy or borrow that moved nothing), frees the blocks it reserved only
once no byte is landing, releases the lender's export, and confirms nothing; a pull
that succeeds confirms and releases nothing."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from splitserve.decode_worker.handover import Handover
from splitserve.decode_worker.migration import Migration
from splitserve.decode_worker.outbox import Outbox
from splitserve.decode_worker.precopy import PreCopier
from splitserve.engine import commands
from splitserve.kv_transfer.leased_pull import LeasedPull, LeaseState
from splitserve.prefill_worker.borrow import PrefixBorrower
from splitserve.wire.config import EngineConfig
from splitserve.wire.decode import DecodeTask, DecodeWorkerSpec, MovedRequest, PreCopy
from splitserve.wire.errors import IntegrityError, KVTransferError, LeaseExpired, PeerLost
from splitserve.wire.kv import Confirmation, KVDescriptor, KVHandoff
from splitserve.wire.prefill import PrefillTask, PrefixPull
from splitserve.wire.sampling import SamplingParams
from tests.unit.router.fakes import COMPAT, FakePrefill
from tests.waiting import until

PROMPT = list(range(1, 41))  # two full blocks of 16 and a partial one
PARAMS = SamplingParams(max_tokens=8)
SPEC = DecodeWorkerSpec("decode-0", EngineConfig(model="fake", block_size=16), "fake", 5.0, 8)
LONG_LEASE_S = 600.0
SHORT_LEASE_S = 0.2  # the "lease ended" path: the pull outlasts it
DEADLINE_S = 60  # each case takes milliseconds; one that hangs fails its test
FAULTS = ("lender lost", "lease ended", "corrupt bytes", "cancelled")
CALLERS = ("handover", "migration", "precopy", "borrow")


class Lender(FakePrefill):
    """A worker that exports under a lease of ``lease_s``: a prefill's (as a prefill
    worker), a running request's (``lend_running``) or a cached prefix (``lend_prefix``)."""

    def __init__(self, lease_s: float):
        super().__init__("lender-0")
        self.lease_s = lease_s

    def export(self, export_id: str, num_blocks: int) -> KVHandoff:
        desc = KVDescriptor(
            f"{export_id}:t",
            export_id,
            "fake",
            self.worker_id,
            self.incarnation,
            COMPAT.hash,
            tuple(range(num_blocks)),
            16 * num_blocks,
            0,
            (),
            lease_expiry=time.time() + self.lease_s,
        )
        return KVHandoff(self.worker_id, (desc,))

    def _handoff(self, task: PrefillTask) -> KVHandoff:
        return self.export(task.request_id, 3)

    async def lend_running(self, loan) -> KVHandoff:
        return self.export(loan.loan_id, 2)

    async def lend_prefix(self, loan) -> KVHandoff:
        return self.export(loan.request_id, 2)


class FakePuller:
    """Moves nothing; fails as ``fault`` says. ``landing`` is set while a pull runs; a
    ``cancelled`` pull runs until ``gate`` is set."""

    def __init__(self, fault: str | None):
        self.fault = fault
        self.landing = False
        self.pulling = asyncio.Event()
        self.gate = asyncio.Event()

    async def link(self, source, handoff: KVHandoff) -> None:
        if self.fault == "lender lost":
            raise PeerLost(f"worker {handoff.source_worker} is gone with this KV")

    async def pull(self, handoff: KVHandoff, blocks: list[int], timeout: float):
        self.landing = True
        self.pulling.set()
        try:
            if self.fault == "lease ended":
                await until(lambda: handoff.remaining_lease() <= 0, "the lease to end", DEADLINE_S)
            elif self.fault == "cancelled":
                await self.gate.wait()
            elif self.fault == "corrupt bytes":
                raise IntegrityError("layer 0 of the pulled KV does not match its checksum")
        finally:
            self.landing = False
        return [Confirmation(d.transfer_id, d.source_worker, False) for d in handoff.descriptors], 0.0


@dataclass
class Engine:
    """What the callers' engine holds per id (reserved or allocated blocks), and whether
    any was freed while a pull's bytes were still landing."""

    puller: FakePuller
    held: dict[str, list[int]] = field(default_factory=dict)
    freed_while_landing: bool = False
    requests: dict = field(default_factory=dict)

    def free(self, rid: str) -> bool:
        self.freed_while_landing |= self.puller.landing
        return self.held.pop(rid, None) is not None

    # as PreCopier and PrefixBorrower call it
    def reserve_moving(self, rid, prompt, outputs, params):
        self.held[rid] = [5, 6]
        return 0, [5, 6]

    def fill_moving(self, rid, num_blocks, adapter_digest) -> None:
        pass

    def reserve_prefix(self, loan_id, prefix):
        self.held[loan_id] = [5, 6]
        return 0, [5, 6]

    def abort(self, rid) -> bool:
        return self.free(rid)


class Side:
    """A decode worker as a handover or migration sees it, over ``engine``; its link and
    pull are the puller's."""

    spec = SPEC

    def __init__(self, engine: Engine):
        self.engine = engine
        self.calls: list[asyncio.Task] = []

    async def hold_prefix(self, task) -> int:
        self.engine.held[task.request_id] = []
        return 0

    async def admit(self, task, deadline, lease_s) -> list[int]:
        self.engine.held.setdefault(task.request_id, []).extend([3, 4, 5])
        return [3, 4, 5]

    async def link(self, source, handoff) -> None:
        await self.engine.puller.link(source, handoff)

    async def pull(self, handoff, blocks, timeout):
        return await self.engine.puller.pull(handoff, blocks, timeout)

    async def verify(self, request_id, output_token_ids) -> None:
        pass

    async def activate(self, request_id, output_token_ids, adapter_digest) -> None:
        pass

    def free(self, request_id: str) -> None:
        self.engine.free(request_id)

    def background(self, call) -> None:
        self.calls.append(asyncio.ensure_future(call))


async def _submit_to(engine: Engine, command):
    return commands.run(engine, command, {})


def _start(caller: str, lender: Lender, engine: Engine):
    """(the caller's run as a coroutine, what its engine holds the blocks under, the id
    the lender's export is released by, a function telling from the run's result
    whether it failed, and with what error, if the caller names one)."""
    rid = "r1"
    if caller in ("handover", "migration"):
        side = Side(engine)
        if caller == "handover":
            task = DecodeTask(rid, PROMPT, PARAMS, source=lender)
            way_in = Handover(task, None, Outbox("test"), side)
        else:
            moved = MovedRequest(rid, lender.worker_id, lender.export(rid, 3), [7], "")
            task = DecodeTask(rid, PROMPT, PARAMS, moved=moved, moved_from=lender)
            way_in = Migration(task, None, Outbox("test"), side)
        return way_in.run(), rid, rid, lambda ending: (ending is not None, ending and ending.error)
    call = lambda command: _submit_to(engine, command)  # noqa: E731
    if caller == "precopy":
        copier = PreCopier("decode-1", engine.puller, 16, call, LONG_LEASE_S)
        task = PreCopy(rid, PROMPT, [7], PARAMS, lender, lender.worker_id, 30.0)
        return copier.copy(task), rid, f"{rid}/precopy", lambda held: (held == 0, None)
    borrower = PrefixBorrower("prefill-1", engine.puller, 16, call, 30.0)
    task = PrefillTask(rid, PROMPT, PARAMS, prefix_from=PrefixPull(lender, lender.worker_id, 2))
    loan = f"{rid}/prefix"
    return borrower.borrow(task), loan, loan, lambda borrowed: (borrowed is None, None)


EXPECTED_ERROR = {"lender lost": PeerLost, "lease ended": LeaseExpired, "corrupt bytes": IntegrityError}


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("fault", FAULTS)
def test_each_failure_of_the_pull_frees_after_it_ended_and_releases_the_export(caller, fault):
    async def run():
        lender = Lender(SHORT_LEASE_S if fault == "lease ended" else LONG_LEASE_S)
        engine = Engine(FakePuller(fault))
        work, holder_key, export_id, failed = _start(caller, lender, engine)
        task = asyncio.ensure_future(work)
        if fault == "cancelled":
            await engine.puller.pulling.wait()
            task.cancel()
            for _ in range(20):  # the caller's clean-up runs as far as it can before the pull ends
                await asyncio.sleep(0)
            assert holder_key in engine.held, "the blocks were freed while the pull's bytes landed"
            engine.puller.gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            did_fail, error = failed(await task)
            assert did_fail
            if caller in ("handover", "migration"):
                assert isinstance(error, EXPECTED_ERROR[fault]) and isinstance(error, KVTransferError)
        await until(lambda: export_id in lender.aborted, "the export released on the lender", DEADLINE_S)
        assert holder_key not in engine.held and not engine.freed_while_landing
        assert lender.confirmed == []

    asyncio.run(asyncio.wait_for(run(), DEADLINE_S))


@pytest.mark.parametrize("caller", CALLERS)
def test_a_whole_pull_confirms_and_releases_nothing(caller):
    async def run():
        lender = Lender(LONG_LEASE_S)
        engine = Engine(FakePuller(None))
        work, holder_key, _, failed = _start(caller, lender, engine)
        assert not failed(await work)[0]
        await until(lambda: len(lender.confirmed) == 1, "the pull confirmed to the lender", DEADLINE_S)
        assert lender.aborted == [] and holder_key in engine.held  # the blocks are the caller's now

    asyncio.run(asyncio.wait_for(run(), DEADLINE_S))


def test_a_leased_pull_goes_only_forward_and_ends_once():
    async def run():
        lender, puller = Lender(LONG_LEASE_S), FakePuller(None)
        handoff = lender.export("x", 1)
        calls: list = []
        lease = LeasedPull(puller, lender, "x", lambda c: calls.append(asyncio.ensure_future(c)), "x")
        with pytest.raises(RuntimeError, match="pull in state ASKED"):
            await lease.pull(handoff, [0], 1.0)
        await lease.link(handoff)
        with pytest.raises(RuntimeError, match="link in state LINKED"):
            await lease.link(handoff)
        await lease.pull(handoff, [0], 1.0)
        assert lease.state is LeaseState.CONFIRMED and not lease.unconfirmed
        freed = []
        await lease.end(lambda: freed.append(1))
        await lease.end(lambda: freed.append(2))
        await asyncio.gather(*calls)
        assert freed == [1] and lease.state is LeaseState.ENDED and lender.aborted == []

    asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
