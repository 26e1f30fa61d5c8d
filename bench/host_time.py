"""The engine's host time per token, on a host-bound workload (issue 69, item 4).

A tiny random-weight Llama with SmolLM2's tokenizer and vocabulary (2 layers, hidden
32), whose forward pass costs little next to the engine's own work: scheduling, the
block manager, sampling, outputs, text. ``--batch`` random prompts of
``--input-len`` tokens each generate ``--output-len`` tokens (greedy, ``ignore_eos``):

- offline: ``Engine.generate`` in the process;
- served: one colocated decode worker in the process (its engine thread, its actor
  loop making text and filling outboxes), read by an in-process client: the worker's
  serving path without Ray or gRPC (``bench.serving_efficiency`` measures those).

For each: microseconds of wall time per output token, of host time (wall time less
the time inside the model's forward pass, ``ModelRunner.forward``; on a GPU the
forward's time runs until the device finished it), and the host's share of the wall
time. ``--shape llama3-8b --device cuda`` measures the same on a GPU with
Llama-3-8B's shapes (random bf16 weights; SmolLM2's tokenizer, so its 49152-token
vocabulary): how much of a decode step at ``--batch`` 64 the engine's own work
takes (issue 66's goal: at most 10 %); ``--shape smollm2`` the same for the CPU
engine on a real model. With ``--against
REV`` the same workload runs with that commit's ``splitserve`` too (a temporary git
worktree, fresh processes alternated round by round, as ``bench.engine_guard``), and
the table gives both trees' medians::

    python -m splitserve.bench.host_time
    python -m splitserve.bench.host_time --against 735f172 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from splitserve.bench.engine_guard import checked_out, run_code

WORKLOAD = r"""
import asyncio, json, random, sys, time
import torch
import splitserve
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams

model = sys.argv[1]
batch, input_len, output_len, threads, kv_mib = map(int, sys.argv[2:7])
device, dtype, random_weights = sys.argv[7], sys.argv[8], sys.argv[9] == "1"
torch.set_num_threads(threads)
config = EngineConfig(
    model=model, dtype=dtype, device=device, random_weights=random_weights, kv_cache_memory_mib=kv_mib
)
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
params = SamplingParams(max_tokens=output_len, ignore_eos=True)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 30000) for _ in range(input_len)] for _ in range(batch)]


class Clock:
    # seconds inside the runner's forward pass, wrapped on the instance
    def __init__(self, runner):
        self.s, forward = 0.0, runner.forward

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                out = forward(*a, **k)
                sync()  # the device's work is the forward's time, not the host's
                return out
            finally:
                self.s += time.perf_counter() - t

        runner.forward = timed


def offline():
    engine = Engine(config)
    clock = Clock(engine.runner)
    engine.generate(prompts[:8], params)  # warm
    clock.s = 0.0
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    return wall, clock.s, sum(len(o.token_ids) for o in outs)


def served():
    from splitserve.decode_worker.in_process import InProcessDecodeClient
    from splitserve.decode_worker.worker import DecodeWorker
    from splitserve.wire.decode import DecodeTask, DecodeWorkerSpec

    worker = DecodeWorker(DecodeWorkerSpec("host-time", config, None, 30.0, 8, torch_threads=threads))
    clock = Clock(worker.engine.runner)
    client = InProcessDecodeClient(worker)

    async def one(rid, prompt):
        n = 0
        async for b in client.generate(DecodeTask(rid, prompt, params)):
            n += len(b.token_ids)
        return n

    async def run(tag, some):
        return sum(await asyncio.gather(*(one(f"{tag}-{i}", p) for i, p in enumerate(some))))

    async def main():
        await run("warm", prompts[:8])
        clock.s = 0.0
        t = time.perf_counter()
        n = await run("run", prompts)
        wall = time.perf_counter() - t
        await client.close()
        return wall, clock.s, n

    try:
        return asyncio.run(main())
    finally:
        worker.shutdown()


got = {"tree": splitserve.__path__[0]}
for name, fn in (("offline", offline), ("served", served)):
    wall, model_s, n = fn()
    got[name] = 1e6 * wall / n
    got[name + "_host"] = 1e6 * (wall - model_s) / n
    got[name + "_share"] = 100 * (wall - model_s) / wall
print("RATES " + json.dumps(got))
"""

ROWS = ("offline", "offline_host", "offline_share", "served", "served_host", "served_share")
VOCAB = 49152  # SmolLM2's tokenizer's


def make_model(directory: Path, shape: str, tokenizer: Path | None = None) -> str:
    """The model (``tiny``: 2 layers, hidden 32, saved; ``llama3-8b``: its config only,
    for random weights), with the tokenizer files of ``tokenizer`` (a directory;
    default SmolLM2's, from its package); its path. ``smollm2``: SmolLM2 itself."""
    from splitserve.bench.tiny_models import make_hf_checkpoint
    from splitserve.engine.model.loader import resolve_source

    if shape == "smollm2":  # the real model as its package gives it
        return str(resolve_source("smollm2").directory)
    source = tokenizer if tokenizer is not None else resolve_source("smollm2").directory
    if not (Path(source) / "tokenizer.json").exists():
        raise SystemExit(
            f"{source} has no tokenizer.json (bench/device_prepare.py packs SmolLM2's for a GPU)"
        )
    if shape == "tiny":
        make_hf_checkpoint(
            "llama", directory, max_position=2048, vocab_size=VOCAB, hidden_size=32, intermediate_size=64
        )
    else:
        from splitserve.bench.gpu_bench import SHAPES

        config = {**SHAPES[shape], "vocab_size": VOCAB, "architectures": ["LlamaForCausalLM"]}
        config.update(
            model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16"
        )
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(config))
    for f in Path(source).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("vocab.json", "merges.txt"):
            shutil.copy(f, directory / f.name)
    return str(directory)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="also run this commit's engine, alternated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument("--shape", choices=["tiny", "llama3-8b", "smollm2"], default="tiny")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on a GPU")
    ap.add_argument("--kv-mib", type=int, default=None, help="KV cache (default 256 MiB; 4 GiB for 8B)")
    ap.add_argument("--tokenizer", type=Path, help="a directory with tokenizer.json (default: SmolLM2's)")
    ap.add_argument("--json", type=Path, help="also write the medians here, by tree and row")
    args = ap.parse_args(argv)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    kv_mib = args.kv_mib or (256 if args.shape == "tiny" else 4096)
    with tempfile.TemporaryDirectory(prefix="host-time-") as tmp:
        model = make_model(Path(tmp) / "model", args.shape, args.tokenizer)
        numbers = (args.batch, args.input_len, args.output_len, args.threads, kv_mib)
        random_weights = "1" if args.shape == "llama3-8b" else "0"
        argv_side = [model, *map(str, numbers), args.device, dtype, random_weights]
        with checked_out(args.against) as package:
            sides = [("this tree", None)] + ([(args.against, package)] if args.against else [])
            samples: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sides}
            for r in range(args.rounds):
                for name, where in sides if r % 2 == 0 else list(reversed(sides)):
                    got = run_code(WORKLOAD, where, argv_side)
                    samples[name].append(got)
                    figures = ", ".join(f"{k} {got[k]:.1f}" for k in ROWS)
                    print(f"round {r + 1}: {name} ({got['tree']}): {figures} us/token", flush=True)
    names = [name for name, _ in sides]
    print("\n| us per output token (share: % of the wall time) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    medians = {n: {row: statistics.median(s[row] for s in samples[n]) for row in ROWS} for n in names}
    for row in ROWS:
        print(f"| {row.replace('_', ' ')} | " + " | ".join(f"{medians[n][row]:.1f}" for n in names) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(medians, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
