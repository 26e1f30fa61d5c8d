"""The router process loads neither torch nor Ray nor any worker implementation: it
imports only plain-data records (and unpickles what workers send it), and its
package imports none of the engine's or the workers'. And no two top-level
packages import each other: dependencies go one way."""

from __future__ import annotations

import ast
import collections
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib, pathlib, pickle, sys
root = pathlib.Path(sys.argv[1])
for path in sorted(root.rglob("*.py")):
    importlib.import_module(".".join(["splitserve.router", *path.relative_to(root).with_suffix("").parts]))
from splitserve.wire.decode import TokenBatch
from splitserve.wire.sampling import FinishReason, SamplingParams
from splitserve.wire.validation import RequestValidator
from splitserve.wire.prefill import PrefillResult
validator = RequestValidator("m", vocab_size=10, max_model_len=8, max_kv_tokens=8, tokenizer=None)
batch = TokenBatch("r", [1], "", [], [], FinishReason.STOP, 0)
pickle.loads(pickle.dumps((validator, SamplingParams(), batch)))
loaded = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("torch", "transformers", "ray")
    or m in ("splitserve.prefill_worker.worker", "splitserve.decode_worker.worker")
    or m == "splitserve.engine.engine"
)
print(",".join(loaded))
"""


def test_every_router_module_imports_without_torch_ray_or_worker_code():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "router")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the router loaded: {out.stdout.strip()}"


def _imported(path: pathlib.Path) -> list[str]:
    """Every module ``path`` imports by absolute name, at any depth (inside functions too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def _package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the files, over every top-level package."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "tests"}
    edges: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for pkg in packages:
        for path in (ROOT / pkg).rglob("*.py"):
            for name in _imported(path):
                parts = name.split(".")
                if parts[0] == "splitserve" and len(parts) > 1 and parts[1] in packages - {pkg}:
                    edges[(pkg, parts[1])].append(str(path.relative_to(ROOT)))
    return edges


def test_no_two_packages_import_each_other():
    edges = _package_imports()
    assert ("cluster", "router") in edges  # the walk sees imports (it would pass on nothing)
    cycles = {(a, b): (edges[(a, b)], edges[(b, a)]) for a, b in edges if (b, a) in edges and a < b}
    assert cycles == {}, cycles


def test_no_two_engine_subpackages_import_each_other():
    """Inside ``engine/``, at folder level: model builds on parallel, attention and
    kernels, never the other way (compatibility checks over the model's shapes live
    with the model: ``engine.model.parallel_fit``)."""
    folders = {p.name for p in (ROOT / "engine").iterdir() if (p / "__init__.py").exists()}
    edges: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for folder in folders:
        for path in (ROOT / "engine" / folder).rglob("*.py"):
            for name in _imported(path):
                parts = name.split(".")
                if (
                    parts[:2] == ["splitserve", "engine"]
                    and len(parts) > 2
                    and parts[2] in folders - {folder}
                ):
                    edges[(folder, parts[2])].append(str(path.relative_to(ROOT)))
    assert ("model", "parallel") in edges
    cycles = {(a, b): (edges[(a, b)], edges[(b, a)]) for a, b in edges if (b, a) in edges and a < b}
    assert cycles == {}, cycles


def test_the_router_imports_no_engine_or_worker_package():
    """The request core stands on ``wire`` alone: not even a plain-asyncio helper of the
    engine's (``Background`` lives in ``wire``)."""
    edges = _package_imports()
    assert ("router", "wire") in edges
    imported = {b: files for (a, b), files in edges.items() if a == "router"}
    for pkg in ("engine", "prefill_worker", "decode_worker", "kv_transfer", "cluster", "bench"):
        assert pkg not in imported, (pkg, imported.get(pkg))


def test_wire_imports_only_the_standard_library_and_itself():
    """The records every process unpickles load in any of them: no torch, no Ray,
    no other splitserve package, not even inside a function."""
    foreign = []
    for path in sorted((ROOT / "wire").glob("*.py")):
        for name in _imported(path):
            parts = name.split(".")
            if parts[0] == "splitserve" and parts[1:2] == ["wire"]:
                continue
            if parts[0] == "__future__" or parts[0] in sys.stdlib_module_names:
                continue
            foreign.append(f"{path.name}: {name}")
    assert len(list((ROOT / "wire").glob("*.py"))) > 5
    assert foreign == []


def test_no_package_imports_the_studies():
    """``bench`` holds studies run by hand; nothing shipped depends on them (the
    user-facing benchmark, ``splitserve bench serve|compare``, is ``loadgen``)."""
    edges = _package_imports()
    assert ("bench", "loadgen") in edges and ("cli", "loadgen") in edges
    importers = {a: files for (a, b), files in edges.items() if b == "bench"}
    assert importers == {}, importers


def test_the_request_core_imports_no_front_door():
    """The OpenAI layer (``router/openai/``) stands on the request core, never the
    other way: dispatch, lifecycle, registry, balancer and decider import neither it
    nor the gRPC service."""
    core = ("dispatch", "lifecycle", "registry", "balancer", "decider")
    found = {
        f"{m}.py": name
        for m in core
        for name in _imported(ROOT / "router" / f"{m}.py")
        if name.startswith(
            ("splitserve.router.openai", "splitserve.router.service", "splitserve.router.server")
        )
    }
    assert found == {}
    assert any(n.startswith("splitserve.router.") for n in _imported(ROOT / "router" / "dispatch.py"))


def _module_graph() -> dict[str, set[str]]:
    """Module -> the splitserve modules it imports at run time (any depth, not under
    ``if TYPE_CHECKING:``; ``from package import module`` counts the module only)."""
    files = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv") or rel.parts[0].startswith(".") or "egg-info" in rel.parts[0]:
            continue
        name = ".".join(("splitserve", *rel.with_suffix("").parts)).removesuffix(".__init__")
        files[name] = path
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                graph[name] |= subs or ({node.module} & files.keys())
        graph[name].discard(name)  # a function run elsewhere (``cluster.worker_client``) reads its own
    return graph


def test_no_module_imports_one_that_imports_it_back():
    """No import circle between modules anywhere, the studies in ``bench/`` included (a
    circle works only in the order its modules happen to load)."""
    graph = _module_graph()
    assert "splitserve.engine.model.loader" in graph["splitserve.engine.build"]  # the walk sees imports
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for dep in sorted(graph[module]):
            if seen.get(dep) == 1:
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in seen:
                visit(dep, [*path, dep])
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
    assert circles == []
