"""Faults in a handoff, each caught, and what the meaning check costs (issue 68).

Three parts:

- **cluster**: every fault of ``wire.faults`` through the real path (a prefill and a
  decode worker as Ray actors, KV over NIXL, the router in front; ``bench.cluster_faults``),
  one at a time, with the meaning check on, then the placement faults again with it off
  (the mutation check: what the checksums alone would let through). Each row: the check
  that caught it, the client's tokens against the monolithic engine's, the blocks held
  afterwards, the time to detect, the trace's sentence.

and in this process (two engines: a prefill engine whose KV a decode engine imports, as
a handoff delivers it):

- **faults**: a prompt's KV, imported with one placement fault at a time (the bytes the
  source sent, so the transfer's checksums pass; every fault of ``wire.faults`` at the
  sink the model's cache can have: a block table with its first and last blocks
  swapped, two layers swapped, a prefix block holding the KV of other positions, two KV
  heads swapped, K and V swapped, an FP8 cache's scales of two layers swapped, MLA's
  latent and rope parts swapped), checked by meaning (``Engine.verify_import``). Each
  row: caught or not, by which check, its error against the tolerance, the time the
  check took. Tiny random Llama (float32 and an FP8 cache) and DeepSeek-V3 (MLA).
- **cost**: decode tokens/s of ``--requests`` imported requests (``--input-len`` prompt
  tokens, ``--output-len`` out, SmolLM2 bf16 by default) with ``--rate`` of them (all
  by default) checked before they run against none, alternated ``--rounds`` times in
  one run: what ``transfer.verify_meaning`` at that rate costs a decode worker that
  takes all its requests by handoff.

    python -m splitserve.bench.handoff_faults
    python -m splitserve.bench.handoff_faults --skip-cost --skip-cluster
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import MeaningMismatch
from splitserve.wire.faults import HandoffFault
from splitserve.wire.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def prefill(source: Engine, rid: str, prompt: list[int], params: SamplingParams):
    """``prompt`` prefilled on ``source``: its KV blocks' contents, its first token."""
    source.add_request(prompt, params, rid, prefill_only=True)
    while source.has_unfinished():
        source.step()
    pre = source.prefilled(rid)
    data = source.kv_cache.read_blocks(pre.block_ids)
    source.release(rid)
    return data, pre.output_token_ids


SINK_FAULTS = tuple(f for f in HandoffFault if f.side == "sink")  # right bytes, wrong place


def fault_rows(kind: str, fp8: bool) -> list[list[str]]:
    """A prompt's KV imported as sent, then with each placement fault its cache can have
    (``Engine.inject_fault``), checked by meaning: a row each."""
    from splitserve.bench.tiny_models import make_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        make_hf_checkpoint(kind, Path(tmp))
        extra = {"kv_cache_dtype": "fp8"} if fp8 else {}
        config = EngineConfig(model=tmp, dtype="float32", block_size=8, num_kv_blocks=96, **extra)
        source, sink = Engine(config), Engine(config)
        prompt = [random.Random(3).randrange(1, 512) for _ in range(29)]
        data, first = prefill(source, "p", prompt, GREEDY)
        out = []
        for n, fault in enumerate((None, *SINK_FAULTS)):
            rid = f"r{n}"
            sink.kv_cache.write_blocks(sink.import_request(rid, prompt, first, GREEDY), data)
            try:
                if fault is not None:
                    sink.inject_fault(rid, fault)
            except ValueError:  # a fault this model's cache cannot have
                sink.abort(rid)
                continue
            began = time.perf_counter()
            try:
                check = sink.verify_import(rid)
            except MeaningMismatch as e:
                check = e.check
            ms = (time.perf_counter() - began) * 1e3
            sink.abort(rid)
            label = f"{kind}{' fp8 KV' if fp8 else ''}"
            verdict = "passed" if check.ok else f"caught ({check.check})"
            error = (
                f"{check.error:.3g} / {check.tolerance:g}"
                if check.check == "kv" or check.ok
                else check.detail
            )
            name = "none (the KV as sent)" if fault is None else fault.value
            out.append([label, name, verdict, error, f"{ms:.1f}"])
        return out


def cost(args) -> None:
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_mib=1024)
    source, sink = Engine(config), Engine(config)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    handed = [prefill(source, f"p{i}", p, params) for i, p in enumerate(prompts)]
    rates: dict[bool, list[float]] = {False: [], True: []}

    def run(verify: bool, tag: str) -> float:
        ids = []
        for i, (prompt, (data, first)) in enumerate(zip(prompts, handed)):
            rid = f"{tag}-{i}"
            sink.kv_cache.write_blocks(sink.import_request(rid, prompt, first, params), data)
            ids.append(rid)
        began = time.perf_counter()
        for k, rid in enumerate(ids):
            if verify and k < round(args.rate * len(ids)):
                sink.verify_import(rid)
            sink.activate(rid)
        n = 0
        while sink.has_unfinished():
            n += sum(len(o.new_token_ids) for o in sink.step_tokens())
        return n / (time.perf_counter() - began)

    run(False, "warm")
    for r in range(args.rounds):
        for verify in (False, True) if r % 2 == 0 else (True, False):
            rates[verify].append(run(verify, f"{r}-{verify}"))
            print(
                f"round {r + 1}: {'checked' if verify else 'unchecked'} {rates[verify][-1]:,.0f} tok/s",
                flush=True,
            )
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(
        f"\n{args.model} {args.dtype}, {args.requests} imported requests of "
        f"{args.input_len}/{args.output_len} tokens: decode {off:,.0f} tok/s unchecked, "
        f"{on:,.0f} with {args.rate:.0%} of them checked: {on / off:.3f}x"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--skip-cluster", action="store_true")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--rate", type=float, default=1.0, help="the share of requests checked (transfer.verify_meaning)"
    )
    args = ap.parse_args(argv)
    rows = [
        r
        for kind, fp8 in (("llama", False), ("llama", True), ("deepseek_v3", False))
        for r in fault_rows(kind, fp8)
    ]
    print("| model | fault | meaning check | error / tolerance | check ms |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    faulted = [r for r in rows if not r[1].startswith("none")]
    caught = sum(r[2].startswith("caught") for r in faulted)
    clean = all(r[2] == "passed" for r in rows if r[1].startswith("none"))
    print(f"\ncaught {caught}/{len(faulted)} placement faults; the KV as sent passed: {clean}\n", flush=True)
    ok = caught == len(faulted) and clean
    if not args.skip_cluster:
        ok = through_the_cluster() and ok
    if not args.skip_cost:
        cost(args)
    return 0 if ok else 1


def through_the_cluster() -> bool:
    """The cluster part: every fault caught with the check on, the clean requests' tokens
    equal; with it off, what the placement faults do unseen. Whether all were caught."""
    from splitserve.bench import cluster_faults as cf

    rows, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for setup in cf.SETUPS:
            got = cf.run_setup(setup, Path(tmp), 1.0, log=lambda m: print(m, file=sys.stderr, flush=True))
            on += got
            rows += cf.table(setup, got, 1.0)
        for setup in cf.SETUPS:  # the mutation check: the placement faults with the check off
            sink = dataclasses.replace(setup, faults=tuple(f for f in setup.faults if f.side == "sink"))
            rows += cf.table(sink, cf.run_setup(sink, Path(tmp), 0.0)[1:], 0.0)
    print("| " + " | ".join(cf.HEADER) + " |")
    print("|" + "---|" * len(cf.HEADER))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    faulted = [r for r in on if r.fault is not None]
    caught = sum(r.caught and r.tokens_equal and r.held_after == 0 for r in faulted)
    clean = all(r.caught_by == "" and r.tokens_equal for r in on if r.fault is None)
    print(
        f"\nthrough the cluster: {caught}/{len(faulted)} faults caught, recomputed to the engine's "
        f"tokens, nothing held after; the correct handoffs passed untouched: {clean}\n",
        flush=True,
    )
    return caught == len(faulted) and clean


if __name__ == "__main__":
    sys.exit(main())
