"""The workers reach their engine only through its methods for them: no worker module
reads or writes the engine's own parts (its request table, block manager, scheduler,
runner, layer observer). A check over the source, so that a new reach fails here."""

from __future__ import annotations

import ast
import pathlib

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
