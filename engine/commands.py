"""The engine's side of ``wire.engine_commands``: each record run as the ``Engine``
method it names, on the engine's thread (``EngineLoop.submit``)."""

from __future__ import annotations

from typing import Any

from splitserve.engine.engine import Engine
from splitserve.wire import engine_commands as c


def run(engine: Engine, command: c.EngineCommand) -> Any:
    """Run ``command`` on ``engine``: its method's result, or its error raised."""
    match command:
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
            return engine.abort(command.request_id)
        case c.HoldPrefix():
            return engine.hold_prefix(command.request_id, command.prompt_token_ids, command.params)
        case c.ImportRequest():
            return engine.import_request(
                command.request_id, command.prompt_token_ids, command.output_token_ids, command.params
            )
        case c.Activate():
            return engine.activate(command.request_id, command.output_token_ids)
        case c.ReserveMoving():
            return engine.reserve_moving(
                command.request_id, command.prompt_token_ids, command.output_token_ids, command.params
            )
        case c.FillMoving():
            return engine.fill_moving(command.request_id, command.num_blocks)
        case c.ReservePrefix():
            return engine.reserve_prefix(command.loan_id, command.token_ids)
        case c.Withdraw():
            return engine.withdraw(command.request_id)
        case c.MeasureRates():
            return engine.measure_rates(command.num_tokens)
        case c.Snapshot():
            return engine.stats(), engine.prefix_update(command.prefix_since)
    raise TypeError(f"not an engine command: {command!r}")
