"""What Python's cyclic garbage collector costs an engine, with the heap as built and
frozen (``gc.freeze``, as ``EngineLoop.start`` does): an engine of ``--model`` decodes
``--requests`` random prompts offline twice in one process, timing every collection
by generation (``gc.callbacks``). A collection holds the GIL throughout, so in a worker
every thread stands still for it, the engine's steps included.

    python -m splitserve.bench.gc_pause --model DIR   # e.g. bench.host_time's tiny model
    python -m splitserve.bench.gc_pause               # SmolLM2
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from splitserve.bench import harness
from splitserve.engine.engine import Engine
from splitserve.loadgen.workloads import random_requests
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams


def collections_while(fn) -> tuple[float, dict[int, tuple[int, float]]]:
    """``fn()``'s wall seconds, and per generation (collections, seconds spent in them)."""
    spent = {g: [0, 0.0] for g in range(3)}
    began = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            counts = spent[info["generation"]]
            counts[0] += 1
            counts[1] += time.perf_counter() - began[0]

    gc.callbacks.append(timed)
    try:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(timed)
    return wall, {g: (c, s) for g, (c, s) in spent.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    harness.add_json_argument(ap)
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    faulting = engine.kv_cache.faulting_in
    if faulting is not None:
        faulting.join()  # its calls take the GIL too: not part of this measure
    vocab = engine.model_config.vocab_size
    prompts = [r.prompt_ids for r in random_requests(args.requests, args.input_len, 1, vocab, seed=0)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    engine.generate(prompts[:4], params)  # warm-up
    rows, pauses = [], {}
    for label in ("as built", "frozen"):
        if label == "frozen":
            gc.collect()
            gc.freeze()
        tracked = len(gc.get_objects())
        wall, spent = collections_while(lambda: engine.generate(prompts, params))
        total = sum(s for _, s in spent.values())
        count2, seconds2 = spent[2]
        pauses[label] = total
        rows.append(
            [label, tracked, f"{wall:.2f}", f"{total * 1e3:.0f}", f"{total / wall:.1%}", count2]
            + [f"{seconds2 / max(count2, 1) * 1e3:.0f}"]
        )
    gc.unfreeze()
    print(f"model {args.model}, {args.requests} x {args.input_len}/{args.output_len} tokens offline")
    header = ["heap", "objects tracked", "wall s", "in collections ms", "share", "full ones", "ms each"]
    print(harness.table(header, rows))
    harness.report(
        "collection time, frozen / as built", pauses["frozen"] / max(pauses["as built"], 1e-9), args.json
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
