"""Placement faults in a handoff, and what the meaning check costs (issue 68).

Two parts, in this process (two engines: a prefill engine whose KV a decode engine
imports, as a handoff delivers it; ``tests/integration/test_meaning_check.py`` runs a
fault through the real two-process path and the router):

- **faults**: a prompt's KV, imported with one placement fault at a time (the bytes the
  source sent, so the transfer's checksums pass: a block table with its first and last
  blocks swapped, two layers swapped, a prefix block holding another prompt's KV, two
  KV heads swapped, K and V swapped, an FP8 cache's scales of two layers swapped, MLA's
  latent and rope parts rotated), checked by meaning (``Engine.verify_import``). Each
  row: caught or not, by which check, its error against the tolerance, the time the
  check took. Tiny random Llama (float32 and an FP8 cache) and DeepSeek-V3 (MLA).
- **cost**: decode tokens/s of ``--requests`` imported requests (``--input-len`` prompt
  tokens, ``--output-len`` out, SmolLM2 bf16 by default) with ``--rate`` of them (all
  by default) checked before they run against none, alternated ``--rounds`` times in
  one run: what ``transfer.verify_meaning`` at that rate costs a decode worker that
  takes all its requests by handoff.

    python -m splitserve.bench.handoff_faults
    python -m splitserve.bench.handoff_faults --skip-cost
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import MeaningMismatch
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


def faults(kind: str, fp8: bool, other_block0: torch.Tensor) -> dict:
    """name -> (how: "data" | "order" | "scales", a function of the KV data)."""
    rows = {
        "block table: first and last swapped": ("order", None),
        "two layers swapped": ("data", lambda d: d[[1, 0]]),
        "a prefix block of another prompt": ("data", lambda d: _block0(d, other_block0)),
    }
    if kind == "llama":
        rows["two KV heads swapped"] = ("data", lambda d: d[..., [1, 0], :])
        rows["K and V swapped"] = ("data", lambda d: d[:, [1, 0]])
    if fp8:
        rows["FP8 scales of two layers swapped"] = ("scales", None)
    if kind == "deepseek_v3":
        rows["MLA latent and rope parts rotated"] = ("data", lambda d: torch.roll(d, 16, dims=-1))
    return rows


def _block0(data: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    out = data.clone()
    out[:, :, 0] = other
    return out


def fault_rows(kind: str, fp8: bool) -> list[list[str]]:
    from splitserve.bench.tiny_models import make_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        make_hf_checkpoint(kind, Path(tmp))
        extra = {"kv_cache_dtype": "fp8"} if fp8 else {}
        config = EngineConfig(model=tmp, dtype="float32", block_size=8, num_kv_blocks=96, **extra)
        source, sink = Engine(config), Engine(config)
        rng = random.Random(3)
        prompt, other = ([rng.randrange(1, 512) for _ in range(29)] for _ in range(2))
        data, first = prefill(source, "p", prompt, GREEDY)
        other_block0 = prefill(source, "o", other, GREEDY)[0][:, :, 0]
        out = []
        cases = {"none (the KV as sent)": ("data", lambda d: d), **faults(kind, fp8, other_block0)}
        for n, (name, (how, fn)) in enumerate(cases.items()):
            rid = f"r{n}"
            ids = sink.import_request(rid, prompt, first, GREEDY)
            order = [ids[-1], *ids[1:-1], ids[0]] if how == "order" else ids
            sink.kv_cache.write_blocks(order, fn(data) if how == "data" else data)
            saved = None if sink.kv_cache.scales is None else sink.kv_cache.scales.clone()
            if how == "scales":
                sink.kv_cache.scales[[0, 1]] = saved[[1, 0]]
            began = time.perf_counter()
            try:
                check = sink.verify_import(rid)
            except MeaningMismatch as e:
                check = e.check
            ms = (time.perf_counter() - began) * 1e3
            if saved is not None:
                sink.kv_cache.scales.copy_(saved)
            sink.abort(rid)
            label = f"{kind}{' fp8 KV' if fp8 else ''}"
            verdict = "passed" if check.ok else f"caught ({check.check})"
            error = (
                f"{check.error:.3g} / {check.tolerance:g}"
                if check.check == "kv" or check.ok
                else check.detail
            )
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
    if not args.skip_cost:
        cost(args)
    return 0 if caught == len(faulted) and clean else 1


if __name__ == "__main__":
    sys.exit(main())
