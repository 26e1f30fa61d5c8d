"""The engine's side of ``wire.engine_commands``: each record run as the ``Engine``
method it names, on the engine's thread (``EngineLoop.submit``); a record that lends
KV also through the lender it names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from splitserve.engine.engine import Engine
from splitserve.wire import engine_commands as c
from splitserve.wire.decode import MovedRequest
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.kv import KVHandoff, Leases
from splitserve.wire.outputs import PrefilledRequest


class Lender(Protocol):
    """A worker's KV source, lending what its engine holds to other workers under a
    lease (``decode_worker.mover.RequestMover``, ``prefill_worker.worker.PrefillWorker``).
    Its methods run on the engine's thread."""

    worker_id: str

    def lend(self, engine: Engine, request_id: str, kv: PrefilledRequest) -> KVHandoff:
        """Export ``kv`` (the engine holds its blocks, PREFILLED) under a lease; its
        blocks are released if that fails, and the error raised."""

    def release(self, engine: Engine, request_id: str) -> bool:
        """Let go of ``request_id``'s open export, if it has one (its blocks are freed as
        the lender's contract says); whether there was one."""

    def leases(self) -> Leases:
        """What it lends now, and its lease ends so far."""


def run(engine: Engine, command: c.EngineCommand, lenders: Mapping[str, Lender]) -> Any:
    """Run ``command`` on ``engine`` (through ``lenders[command.lender]`` where it names
    one): its method's result, or its error raised."""
    match command:
        case c.MoveOut():
            lender = _lender(lenders, command.lender)
            moved = engine.suspend(command.request_id, command.from_block)
            handoff = lender.lend(engine, command.request_id, moved)
            return MovedRequest(
                command.request_id, lender.worker_id, handoff, moved.output_token_ids, engine.revision
            )
        case c.LendRunning():
            lender, loan = _lender(lenders, command.lender), command.loan
            lent = engine.lend_running(loan.loan_id, loan.request_id, loan.token_ids, loan.from_block)
            return None if lent is None else lender.lend(engine, loan.loan_id, lent)
        case c.LendPrefix():
            lender, loan = _lender(lenders, command.lender), command.loan
            lent = engine.lend_prefix(loan.request_id, loan.token_ids, loan.from_block)
            return None if lent is None else lender.lend(engine, loan.request_id, lent)
        case c.AddRequest():
            if command.adopt is not None:
                engine.adopt_prefix(*command.adopt)
            return engine.add_request(
                command.prompt_token_ids,
                command.params,
                command.request_id,
                prefill_only=command.prefill_only,
                output_token_ids=command.output_token_ids,
                export_from_block=command.export_from_block,
            )
        case c.Abort():
            if command.lender is not None and _lender(lenders, command.lender).release(
                engine, command.request_id
            ):
                return True
            return engine.abort(command.request_id)
        case c.HoldPrefix():
            return engine.hold_prefix(command.request_id, command.prompt_token_ids, command.params)
        case c.ImportRequest():
            return engine.import_request(
                command.request_id, command.prompt_token_ids, command.output_token_ids, command.params
            )
        case c.Activate():
            return engine.activate(command.request_id, command.output_token_ids, command.adapter_digest)
        case c.LoadAdapter():
            return engine.load_adapter(command.name, command.path)
        case c.UnloadAdapter():
            return engine.unload_adapter(command.name)
        case c.VerifyImport():
            return engine.verify_import(command.request_id, command.output_token_ids)
        case c.InjectFault():
            return engine.inject_fault(command.request_id, command.fault)
        case c.ReserveMoving():
            return engine.reserve_moving(
                command.request_id, command.prompt_token_ids, command.output_token_ids, command.params
            )
        case c.FillMoving():
            return engine.fill_moving(command.request_id, command.num_blocks, command.adapter_digest)
        case c.ReservePrefix():
            return engine.reserve_prefix(command.loan_id, command.token_ids)
        case c.Withdraw():
            return engine.withdraw(command.request_id)
        case c.MeasureRates():
            return engine.measure_rates(command.num_tokens)
        case c.Snapshot():
            stats, prefix = engine.stats(), engine.prefix_update(command.prefix_since)
            return (
                stats,
                prefix,
                None if command.lender is None else _lender(lenders, command.lender).leases(),
            )
    raise TypeError(f"not an engine command: {command!r}")


def _lender(lenders: Mapping[str, Lender], name: str) -> Lender:
    lender = lenders.get(name)
    if lender is None:
        raise InvalidRequest(f"this worker lends no KV through {name!r}")
    return lender
