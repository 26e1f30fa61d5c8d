"""The workers reach their engine only through its methods for them: no worker module
reads or writes the engine's own parts (its request table, block manager, scheduler,
runner, layer observer), and what a worker asks of the engine alone is a command
record (``wire.engine_commands``), not a closure. Checks over the source, so that a
new reach fails here; and the engine runs every command as the method it names."""

from __future__ import annotations

import ast
import pathlib
import typing

import pytest

from splitserve.engine import commands
from splitserve.wire import engine_commands
from splitserve.wire.sampling import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKERS = ("decode_worker", "prefill_worker", "elastic_worker")
# the engine's parts that are its own business
INTERNALS = frozenset(
    {
        "requests",
        "block_manager",
        "scheduler",
        "runner",
        "layer_observer",
        "containment",
        "speculation",
        "host_tier",
    }
)


def _is_engine(node: ast.expr) -> bool:
    """``e`` or ``engine`` (an engine call's argument), or ``<anything>.engine``."""
    if isinstance(node, ast.Name):
        return node.id in ("e", "engine")
    return isinstance(node, ast.Attribute) and node.attr == "engine"


def _reaches() -> tuple[list[str], int]:
    """(each reach into an engine internal, as file:line attr; how many engine attributes
    were seen in all)."""
    found, seen = [], 0
    for pkg in WORKERS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and _is_engine(node.value):
                    seen += 1
                    if node.attr in INTERNALS:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.attr}")
    return found, seen


def test_no_worker_module_reaches_into_the_engines_own_parts():
    found, seen = _reaches()
    assert seen > 40  # the walk sees the workers' engine calls (it would pass on nothing)
    assert found == [], found


def _closures_of_one_engine_call() -> list[str]:
    """Each ``lambda e: e.method(...)`` in a worker module: a call that should be a command."""
    found = []
    for pkg in WORKERS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Lambda) and len(node.args.args) == 1:
                    body, arg = node.body, node.args.args[0].arg
                    if (
                        isinstance(body, ast.Call)
                        and isinstance(body.func, ast.Attribute)
                        and isinstance(body.func.value, ast.Name)
                        and body.func.value.id == arg
                    ):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {arg}.{body.func.attr}")
    return found


def test_what_a_worker_asks_of_the_engine_alone_is_a_command():
    assert _closures_of_one_engine_call() == []


class _Recorder:
    """Records the engine methods a command runs (a stand-in for the engine, to test the
    dispatcher)."""

    def __init__(self):
        self.called: list[str] = []

    def __getattr__(self, name):
        def method(*args, **kwargs):
            self.called.append(name)
            return name

        return method


P = SamplingParams(max_tokens=4)
# one of each command, and the engine methods it runs
EXAMPLES = {
    engine_commands.AddRequest: (engine_commands.AddRequest("r1", [1, 2], P), ["add_request"]),
    engine_commands.Abort: (engine_commands.Abort("r1"), ["abort"]),
    engine_commands.HoldPrefix: (engine_commands.HoldPrefix("r1", [1, 2], P), ["hold_prefix"]),
    engine_commands.ImportRequest: (engine_commands.ImportRequest("r1", [1, 2], [3], P), ["import_request"]),
    engine_commands.Activate: (engine_commands.Activate("r1", [3]), ["activate"]),
    engine_commands.ReserveMoving: (engine_commands.ReserveMoving("r1", [1, 2], [3], P), ["reserve_moving"]),
    engine_commands.FillMoving: (engine_commands.FillMoving("r1", 2), ["fill_moving"]),
    engine_commands.ReservePrefix: (engine_commands.ReservePrefix("r1/prefix", [1, 2]), ["reserve_prefix"]),
    engine_commands.Withdraw: (engine_commands.Withdraw("r1"), ["withdraw"]),
    engine_commands.MeasureRates: (engine_commands.MeasureRates(128), ["measure_rates"]),
    engine_commands.Snapshot: (engine_commands.Snapshot(None), ["stats", "prefix_update"]),
}


@pytest.mark.parametrize("kind", typing.get_args(engine_commands.EngineCommand), ids=lambda k: k.__name__)
def test_each_command_runs_the_engine_method_it_names(kind):
    engine = _Recorder()
    command, methods = EXAMPLES[kind]
    commands.run(engine, command)
    assert engine.called == methods


def test_a_borrowed_prefix_is_adopted_in_the_call_that_adds_its_prompt():
    engine = _Recorder()
    add = engine_commands.AddRequest("r1", [1, 2], SamplingParams(), adopt=("r1/prefix", 2))
    commands.run(engine, add)
    assert engine.called == ["adopt_prefix", "add_request"]


def test_anything_else_is_refused():
    with pytest.raises(TypeError, match="not an engine command"):
        commands.run(_Recorder(), "abort r1")
