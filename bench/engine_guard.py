"""The engine against an earlier commit of itself, in the same run: does a change slow it?

Checks the named commit out into a temporary git worktree and runs the same
offline workload with each tree's ``splitserve`` (a fresh process each time, the
trees alternated round by round, so the machine's drift falls on both): random
prompts of ``--input-len`` tokens, ``--output-len`` tokens each, ``--greedy-batch``
of them greedy and ``--sampled-batch`` sampled (temperature 0.8, top_p 0.9; by
default the b64 greedy and b32 sampled rows issue 69 asks about), output tokens/s,
the best of two passes per process. Prints each row's tokens/s per round and the ratio of the
medians, this tree / the commit::

    python -m splitserve.bench.engine_guard                     # against HEAD~1
    python -m splitserve.bench.engine_guard --against 390f27f --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

WORKLOAD = r"""
import json, random, sys, time
import splitserve
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
model, dtype = sys.argv[1], sys.argv[2]
greedy_batch, sampled_batch, input_len, output_len = map(int, sys.argv[3:7])
engine = Engine(EngineConfig(model=model, dtype=dtype, kv_cache_memory_mib=512))
rng = random.Random(0)
most = max(greedy_batch, sampled_batch)
prompts = [[rng.randrange(1000, 30000) for _ in range(input_len)] for _ in range(most)]
rows = {
    "greedy": (greedy_batch, SamplingParams(max_tokens=output_len, ignore_eos=True)),
    "sampled": (
        sampled_batch,
        SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1),
    ),
}
rates = {}
for name, (batch, params) in rows.items():
    best = 0.0
    for _ in range(2):
        started = time.perf_counter()
        outs = engine.generate(prompts[:batch], params)
        best = max(best, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started))
    rates[name] = best
print("RATES " + json.dumps({"tree": splitserve.__path__[0], **rates}))
"""


def run_side(package_dir: Path | None, args: argparse.Namespace) -> dict[str, float]:
    """The workload in a fresh process, with ``package_dir``'s ``splitserve`` (None: the
    installed one)."""
    sizes = (args.greedy_batch, args.sampled_batch, args.input_len, args.output_len)
    return run_code(WORKLOAD, package_dir, [args.model, args.dtype, *map(str, sizes)])


def run_code(code: str, package_dir: Path | None, argv: list[str]) -> dict[str, float]:
    """Run ``code`` with ``argv`` in a fresh Python process importing ``splitserve`` from
    ``package_dir`` (a folder holding a ``splitserve`` link to a tree: ``checked_out``),
    or the installed one (None); the JSON object it printed after ``RATES ``."""
    env = dict(os.environ)
    if package_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_dir), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", code, *argv]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RATES "))
    return json.loads(line.removeprefix("RATES "))


@contextlib.contextmanager
def checked_out(against: str | None) -> Iterator[Path | None]:
    """A folder whose ``splitserve`` is commit ``against`` of this repository (a git
    worktree, removed after), for ``run_code``; None for None."""
    if against is None:
        yield None
        return
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="engine-guard-") as tmp:
        tree, package = Path(tmp) / "tree", Path(tmp) / "package"
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), against], check=True
        )
        try:
            package.mkdir()
            (package / "splitserve").symlink_to(tree)
            yield package
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="HEAD~1", help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--greedy-batch", type=int, default=64)
    ap.add_argument("--sampled-batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args(argv)
    with checked_out(args.against) as package:
        samples: dict[str, list[dict[str, float]]] = {"this tree": [], args.against: []}
        for r in range(args.rounds):
            sides = [("this tree", None), (args.against, package)]
            for name, where in sides if r % 2 == 0 else reversed(sides):
                got = run_side(where, args)
                samples[name].append(got)
                rates = ", ".join(f"{k} {v:,.0f}" for k, v in got.items() if k != "tree")
                print(f"round {r + 1}: {name} ({got['tree']}): {rates} tok/s", flush=True)
    print(f"\n| row | this tree tok/s | {args.against} tok/s | ratio |")
    print("|---|---|---|---|")
    for row in ("greedy", "sampled"):
        mine = statistics.median(s[row] for s in samples["this tree"])
        theirs = statistics.median(s[row] for s in samples[args.against])
        print(f"| {row} | {mine:,.0f} | {theirs:,.0f} | {mine / theirs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
