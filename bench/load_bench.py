"""How much memory and time loading a checkpoint takes, per tensor-parallel rank.

Generates (once, never committed) a random-weight checkpoint with a real model's
config in Hugging Face's layout: bf16, sharded safetensors of at most
``--shard-gib`` each and ``model.safetensors.index.json``. Then, same run:

1. **read**: every file read start to end with large reads (the disk's speed),
   after evicting the files from the page cache (``posix_fadvise DONTNEED``);
2. **load**: ``--tp`` rank processes, each building its engine's model shard
   from the directory (``build_engine``; no collectives run while loading),
   again from a cold page cache. A sampler in this process reads every rank's
   ``RssAnon`` (anonymous resident memory: what the rank itself allocated, not
   the page cache its memory maps show as ``RssFile``) every 10 ms.

It prints each rank's shard bytes, its peak ``RssAnon`` against the bound
``1.15 x shard + 1 GiB``, and load speed ÷ read speed::

    python -m splitserve.bench.load_bench --shape llama3-8b --tp 2 --dir /tmp/llama3-8b-random

``--max-anon-gib`` stops the ranks (and reports it) if their anonymous memory
together passes that many GiB, so a loader that builds the whole model in float32
is measured up to the point it would exhaust the machine, not past it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.bench.gpu_bench import SHAPES as GPU_SHAPES

GIB = 2**30

_LLAMA_3_2 = dict(  # what the Llama-3.2 sizes share
    vocab_size=128256,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
)
SHAPES = {
    "llama3-8b": dict(GPU_SHAPES["llama3-8b"], tie_word_embeddings=False),
    "llama3.2-3b": dict(
        _LLAMA_3_2, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24
    ),
    "llama3.2-1b": dict(
        _LLAMA_3_2, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32
    ),
}


def write_checkpoint(directory: Path, shape: str, shard_gib: float, seed: int = 0) -> None:
    """A random bf16 checkpoint, sharded as ``save_pretrained`` shards it; one
    shard's tensors in memory at a time. Skipped if the directory is complete."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from splitserve.engine.model.config import ModelConfig
    from splitserve.engine.model.placement import checkpoint_tensor_shapes

    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    cfg = SHAPES[shape]
    hf = LlamaConfig(**cfg, torch_dtype="bfloat16")
    hf.save_pretrained(str(directory))
    shapes = checkpoint_tensor_shapes(ModelConfig.from_hf(hf))
    groups: list[list[str]] = [[]]
    size = 0
    for name, s in shapes.items():
        nbytes = 2 * _numel(s)
        if groups[-1] and size + nbytes > shard_gib * GIB:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            if len(shapes[name]) == 1:
                tensors[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(shapes[name], generator=g) * 0.02).to(torch.bfloat16)
            weight_map[name] = fname
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        del tensors
        print(f"  wrote {fname}", flush=True)
    total = sum(2 * _numel(s) for s in shapes.values())
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def evict(files: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (no root needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_speed(files: list[Path]) -> tuple[float, float]:
    """(bytes, seconds) to read every file once with 16 MiB reads, from a cold cache."""
    evict(files)
    buf = bytearray(16 * 2**20)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total, time.perf_counter() - t0


def _rank_main(directory: str, rank: int, size: int, threads: int, out) -> None:
    import torch

    from splitserve.engine.build import build_engine
    from splitserve.engine.parallel.group import TPGroup
    from splitserve.wire.config import EngineConfig

    torch.set_num_threads(threads)
    config = EngineConfig(model=directory, dtype="bfloat16", tp_size=size, num_kv_blocks=4, max_num_seqs=4)
    t0 = time.perf_counter()
    parts = build_engine(config, None, None, TPGroup(rank, size))
    seconds = time.perf_counter() - t0
    shard = shard_bytes(parts.model)
    out.put((rank, seconds, shard))
    out.close()
    out.join_thread()
    os._exit(0)


def shard_bytes(model) -> int:
    """Bytes of every parameter and buffer (tied weights once), plus oneDNN's packed
    weights (opaque tensors without storage: counted as in x out elements)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    packed = sum(
        m.in_features * m.out_features * m.packed.element_size()
        for m in model.modules()
        if getattr(m, "packed", None) is not None
    )
    return sum(seen.values()) + packed


def rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


@dataclass
class RankResult:
    rank: int
    seconds: float
    shard_bytes: int
    peak_anon: int

    @property
    def bound(self) -> int:
        return int(1.15 * self.shard_bytes) + GIB


def load_ranks(directory: Path, size: int, threads: int, max_anon: float) -> tuple[list[RankResult], str]:
    """Start ``size`` rank processes loading ``directory``; sample their RssAnon until
    they report. Returns their results and why they were stopped ('' if they were not)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(str(directory), r, size, threads, out)) for r in range(size)
    ]
    for p in procs:
        p.start()
    peaks = [0] * size
    reports: dict[int, tuple[float, int]] = {}
    stopped = ""
    while len(reports) < size:
        for r, p in enumerate(procs):
            peaks[r] = max(peaks[r], rss_anon(p.pid))
        if sum(peaks) > max_anon * GIB:
            stopped = (
                f"stopped: the ranks' RssAnon passed {max_anon:g} GiB together ({sum(peaks) / GIB:.1f} GiB)"
            )
            break
        if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs):
            stopped = f"a rank died: exit codes {[p.exitcode for p in procs]}"
            break
        while not out.empty():
            rank, seconds, shard = out.get()
            reports[rank] = (seconds, shard)
        time.sleep(0.01)
    for p in procs:
        if stopped:
            p.kill()
        p.join()
    results = [RankResult(r, *reports[r], peaks[r]) for r in sorted(reports)]
    return results, stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--dir", type=Path, required=True, help="where the checkpoint is (or is written)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shard-gib", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--max-anon-gib", type=float, default=20.0)
    args = ap.parse_args()

    write_checkpoint(args.dir, args.shape, args.shard_gib)
    files = sorted(args.dir.glob("*.safetensors"))
    nbytes, read_s = read_speed(files)
    print(f"checkpoint: {args.shape}, {len(files)} files, {nbytes / GIB:.2f} GiB")
    print(f"read: {read_s:.1f} s, {nbytes / read_s / GIB:.2f} GiB/s (cold page cache)")
    evict(files)
    t0 = time.perf_counter()
    results, stopped = load_ranks(args.dir, args.tp, args.threads, args.max_anon_gib)
    wall = time.perf_counter() - t0
    if stopped:
        print(f"load with TP={args.tp}: {stopped}")
        return
    print(f"load with TP={args.tp}: {wall:.1f} s wall (process start included)")
    print("rank  shard GiB  peak RssAnon GiB  bound GiB  within  load s")
    for r in results:
        ok = "yes" if r.peak_anon <= r.bound else "NO"
        print(
            f"{r.rank:>4}  {r.shard_bytes / GIB:>9.2f}  {r.peak_anon / GIB:>16.2f}  {r.bound / GIB:>9.2f}"
            f"  {ok:>6}  {r.seconds:>6.1f}"
        )
    slowest = max(r.seconds for r in results)
    print(
        f"load speed ÷ read speed: {read_s / slowest:.2f} (the slowest rank's load vs one read of the files)"
    )


if __name__ == "__main__":
    main()
