"""The workers reach their engine only through its methods for them: no worker module
reads or writes the engine's own parts (its request table, block manager, scheduler,
runner, layer observer), and what a worker asks of the engine alone is a command
record (``wire.engine_commands``), not a closure. Checks over the source, so that a
new reach fails here; and the engine runs every command as the method it names."""

from __future__ import annotations

import ast
import pathlib
import types
import typing

import pytest

from splitserve.engine import commands
from splitserve.wire import engine_commands
from splitserve.wire.decode import RunningLoan
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.faults import HandoffFault
from splitserve.wire.prefill import PrefixLoan
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
    dispatcher); each returns a record of KV held (as ``suspend`` and the lends do)."""

    def __init__(self, called: list[str] | None = None):
        self.called: list[str] = [] if called is None else called

    def __getattr__(self, name):
        def method(*args, **kwargs):
            self.called.append(name)
            return types.SimpleNamespace(method=name, output_token_ids=[3])

        return method


class _Lender:
    """A lender recording its calls into the engine's list; ``holds``: the requests whose
    export ``release`` finds open."""

    worker_id = "w0"

    def __init__(self, called: list[str], holds: tuple[str, ...] = ()):
        self.called, self.holds = called, holds

    def lend(self, engine, request_id, kv):
        self.called.append("lend")
        return ("handoff", request_id, kv.method)

    def release(self, engine, request_id):
        self.called.append("release")
        return request_id in self.holds

    def leases(self):
        self.called.append("leases")
        return "leases"


P = SamplingParams(max_tokens=4)
# one of each command, and the engine methods it runs
EXAMPLES = {
    engine_commands.AddRequest: (engine_commands.AddRequest("r1", [1, 2], P), ["add_request"]),
    engine_commands.Abort: (engine_commands.Abort("r1"), ["abort"]),
    engine_commands.HoldPrefix: (engine_commands.HoldPrefix("r1", [1, 2], P), ["hold_prefix"]),
    engine_commands.ImportRequest: (engine_commands.ImportRequest("r1", [1, 2], [3], P), ["import_request"]),
    engine_commands.Activate: (engine_commands.Activate("r1", [3]), ["activate"]),
    engine_commands.VerifyImport: (engine_commands.VerifyImport("r1", [3]), ["verify_import"]),
    engine_commands.LoadAdapter: (engine_commands.LoadAdapter("a1", "/adapters/a1"), ["load_adapter"]),
    engine_commands.UnloadAdapter: (engine_commands.UnloadAdapter("a1"), ["unload_adapter"]),
    engine_commands.InjectFault: (
        engine_commands.InjectFault("r1", HandoffFault.LAYERS_SWAPPED),
        ["inject_fault"],
    ),
    engine_commands.ReserveMoving: (engine_commands.ReserveMoving("r1", [1, 2], [3], P), ["reserve_moving"]),
    engine_commands.FillMoving: (engine_commands.FillMoving("r1", 2), ["fill_moving"]),
    engine_commands.ReservePrefix: (engine_commands.ReservePrefix("r1/prefix", [1, 2]), ["reserve_prefix"]),
    engine_commands.Withdraw: (engine_commands.Withdraw("r1"), ["withdraw"]),
    engine_commands.MeasureRates: (engine_commands.MeasureRates(128), ["measure_rates"]),
    engine_commands.Snapshot: (engine_commands.Snapshot(None), ["stats", "prefix_update"]),
    engine_commands.MoveOut: (engine_commands.MoveOut("r1", 2, "moves"), ["suspend", "lend"]),
    engine_commands.LendRunning: (
        engine_commands.LendRunning(RunningLoan("r1/loan", "r1", [1, 2], 0), "moves"),
        ["lend_running", "lend"],
    ),
    engine_commands.LendPrefix: (
        engine_commands.LendPrefix(PrefixLoan("r1", [1, 2], 0), "moves"),
        ["lend_prefix", "lend"],
    ),
}


@pytest.mark.parametrize("kind", typing.get_args(engine_commands.EngineCommand), ids=lambda k: k.__name__)
def test_each_command_runs_the_engine_method_it_names(kind):
    engine = _Recorder()
    command, methods = EXAMPLES[kind]
    commands.run(engine, command, {"moves": _Lender(engine.called)})
    assert engine.called == methods


def test_a_move_lends_what_the_engine_suspended_and_names_the_lender():
    engine = _Recorder()
    moved = commands.run(engine, engine_commands.MoveOut("r1", 2, "moves"), {"moves": _Lender(engine.called)})
    assert moved.request_id == "r1" and moved.worker_id == "w0" and moved.output_token_ids == [3]
    assert moved.handoff == ("handoff", "r1", "suspend")


def test_an_abort_naming_a_lender_releases_an_open_export_instead():
    for holds, methods in ((("r1",), ["release"]), ((), ["release", "abort"])):
        engine = _Recorder()
        lenders = {"prefill": _Lender(engine.called, holds)}
        commands.run(engine, engine_commands.Abort("r1", "prefill"), lenders)
        assert engine.called == methods


def test_a_snapshot_naming_a_lender_takes_its_leases_in_the_same_call():
    engine = _Recorder()
    lenders = {"prefill": _Lender(engine.called)}
    *_, leases = commands.run(engine, engine_commands.Snapshot(None, "prefill"), lenders)
    assert leases == "leases" and engine.called == ["stats", "prefix_update", "leases"]


def test_a_lend_the_engine_holds_nothing_for_lends_nothing():
    class Empty(_Recorder):
        def lend_prefix(self, *args):
            self.called.append("lend_prefix")
            return None

    engine = Empty()
    loan = engine_commands.LendPrefix(PrefixLoan("r1", [1, 2], 0), "moves")
    assert commands.run(engine, loan, {"moves": _Lender(engine.called)}) is None
    assert engine.called == ["lend_prefix"]


def test_a_command_naming_a_lender_the_worker_lacks_is_refused():
    with pytest.raises(InvalidRequest, match="lends no KV through 'moves'"):
        commands.run(_Recorder(), engine_commands.MoveOut("r1", 0, "moves"), {})


def test_a_borrowed_prefix_is_adopted_in_the_call_that_adds_its_prompt():
    engine = _Recorder()
    add = engine_commands.AddRequest("r1", [1, 2], SamplingParams(), adopt=("r1/prefix", 2))
    commands.run(engine, add, {})
    assert engine.called == ["adopt_prefix", "add_request"]


def test_anything_else_is_refused():
    with pytest.raises(TypeError, match="not an engine command"):
        commands.run(_Recorder(), "abort r1", {})
