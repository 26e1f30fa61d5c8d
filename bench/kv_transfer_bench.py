"""KV transfer benchmark: bandwidth per backend against this machine's
single-thread memcpy (the ceiling), and handover time against raw transfer time.

For each layout (SmolLM2-135M: 30 layers x 3 KV heads x 64, and a
Llama-3-8B-shaped one: 32 x 8 x 128; bfloat16, 16-token blocks) and each KV
size (1k, 8k, 32k tokens), a source process (``kv_peers``) holds a pool of
random bytes and exports one request's blocks; this process pulls them into
its own pool. Per backend, the median of ``--repeats`` pulls of:

- raw: one READ of the whole cache with nothing else running (the backend's
  ``_transfer`` over every layer at once, no verification): the floor;
- transfer: moving the bytes into place during a pull (``TransferStats.transfer_s``,
  chunks of layers while the previous chunk is verified), as GB/s and as a
  fraction of memcpy of the same bytes measured in the same run;
- handover: export (publishing, timed in the source) + pull (chunks of layers
  moved, each verified on a helper thread while the next moves): from "prefill
  done" to "decode may start", and its ratio to the raw transfer. The source
  hashes each layer first, as a prefill worker does while the forward pass
  writes it ("hashed in prefill": work moved out of the handover, reported).

Then layer-wise streaming against whole-cache transfer (``--layerwise``, nixl):
a real prefill engine (SmolLM2-135M, prefix caching off) in the source process
prefills one 2k- and one 8k-token prompt (8064: the model's context is 8192),
and this process pulls its KV either after the prefill (whole cache) or while
it computes (streamed). Per mode, the median of ``--repeats`` of: prefill time
(as this process saw it), and prefill end (the source's step returning) to
decode ready (the pull returned here), which is negative when the last layer's
KV arrived before the step finished sampling.

    python -m splitserve.bench.kv_transfer_bench                  # everything, ~10 min
    python -m splitserve.bench.kv_transfer_bench --quick          # 1k and 8k only
    python -m splitserve.bench.kv_transfer_bench --layerwise-only # the streaming table only
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from splitserve.bench import harness
from splitserve.bench.kv_peers import Confirm, ExportRandom, Prefill, SourceProcess, SourceSpec, start_source
from splitserve.engine.kv_cache import allocate_zeros
from splitserve.kv_transfer import get_backend
from splitserve.wire.config import EngineConfig
from splitserve.wire.kv import CompatInfo
from splitserve.wire.kv_layout import KVLayout
from splitserve.wire.sampling import SamplingParams

LAYOUTS = {
    "SmolLM2-135M": dict(num_layers=30, num_kv_heads=3, head_dim=64),
    "Llama-3-8B": dict(num_layers=32, num_kv_heads=8, head_dim=128),
}
BLOCK = 16


@dataclass
class Row:
    layout: str
    tokens: int
    backend: str
    mbytes: float
    memcpy_gbps: float
    transfer_gbps: float
    of_memcpy: float
    raw_ms: float
    transfer_ms: float
    export_ms: float
    hashed_in_prefill_ms: float
    verify_ms: float
    handover_ms: float
    handover_ratio: float


@dataclass
class LayerwiseRow:
    tokens: int
    mode: str  # whole | streamed
    mbytes: float
    prefill_ms: float
    end_to_ready_ms: float


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """Single-thread libc memcpy between two pre-faulted buffers allocated like the KV
    pools (huge pages where available), best of ``repeats``."""
    src = allocate_zeros((nbytes,), torch.uint8).fill_(1)  # the same pages as the KV pools
    dst = allocate_zeros((nbytes,), torch.uint8).zero_()  # faulted in (allocate_zeros does not)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def run_one(backend: str, name: str, tokens: int, repeats: int, ceiling: float) -> Row:
    nblocks = -(-tokens // BLOCK)
    lay = KVLayout(num_blocks=nblocks, block_size=BLOCK, dtype="bfloat16", **LAYOUTS[name])
    compat = CompatInfo(model="random", layout=lay)
    src = start_source(SourceSpec(backend, layout=lay))
    try:
        cache = torch.zeros(
            lay.num_layers, 2, nblocks, BLOCK, lay.num_kv_heads, lay.head_dim, dtype=torch.bfloat16
        )
        sink = get_backend(backend).sink("bench-decode", cache, compat)
        sink.connect(src.handshake)
        samples = []
        everything = range(lay.num_layers)
        for _ in range(repeats + 1):  # the first pull also sets up the connection: not counted
            exp = src.call(ExportRandom(num_tokens=tokens))
            t0 = time.monotonic()
            sink._transfer(exp.descriptor, list(range(nblocks)), t0 + 120.0, everything)
            raw = time.monotonic() - t0
            exp = src.call(ExportRandom(num_tokens=tokens))
            conf = sink.pull(exp.descriptor, list(range(nblocks)), timeout=120.0)
            if not conf.delivered:
                src.call(Confirm(conf.transfer_id))
            st = sink.last_stats
            samples.append((st.transfer_s, exp.export_s, exp.hash_s, st.verify_s, exp.export_s + st.total_s))
        sink.close()
    finally:
        src.stop()
    transfer, export, hashed, verify, handover = (statistics.median(x) for x in zip(*samples[1:]))
    nbytes = exp.descriptor.num_bytes
    gbps = nbytes / transfer / 1e9
    return Row(
        name,
        tokens,
        backend,
        nbytes / 1e6,
        ceiling,
        gbps,
        gbps / ceiling,
        raw * 1e3,
        transfer * 1e3,
        export * 1e3,
        hashed * 1e3,
        verify * 1e3,
        handover * 1e3,
        handover / raw,
    )


LAYERWISE_TOKENS = (2048, 8064)


def run_layerwise(tokens: int, stream: bool, repeats: int) -> LayerwiseRow:
    """Prefill one ``tokens``-token prompt in a source process and pull its KV, after
    the prefill or while it runs; medians of ``repeats`` (after one warm-up)."""
    engine = EngineConfig(model="smollm2", enable_prefix_caching=False, num_kv_blocks=tokens // BLOCK + 8)
    src = SourceProcess(SourceSpec("nixl", engine=engine, lease_s=600.0))
    try:
        compat = src.handshake.compat
        lay = dataclasses.replace(compat.layout, num_blocks=-(-tokens // BLOCK) + 1)
        cache = allocate_zeros(
            (lay.num_layers, 2, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim),
            getattr(torch, lay.dtype),
        ).zero_()  # faulted in, as a cache in use is (allocate_zeros does not)
        sink = get_backend("nixl").sink("bench-decode", cache, dataclasses.replace(compat, layout=lay))
        sink.connect(src.handshake)
        rng = random.Random(tokens)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        samples = []
        for _ in range(repeats + 1):
            prompt = [rng.randrange(1000, 30000) for _ in range(tokens)]
            sent = time.time()
            src.send(Prefill([prompt], params, stream=stream))
            if stream:
                (desc,) = src.receive().descriptors
                sink.pull(desc, list(range(len(desc.block_ids))), timeout=600.0)
                ready = time.time()
                (exp,) = src.receive()
            else:
                (exp,) = src.receive()
                desc = exp.descriptor
                sink.pull(desc, list(range(len(desc.block_ids))), timeout=600.0)
                ready = time.time()
            samples.append((exp.prefill_end - sent, ready - exp.prefill_end))
        sink.close()
    finally:
        src.stop()
    prefill, to_ready = (statistics.median(x) for x in zip(*samples[1:]))
    mode = "streamed" if stream else "whole"
    return LayerwiseRow(tokens, mode, desc.num_bytes / 1e6, prefill * 1e3, to_ready * 1e3)


def layerwise_table(repeats: int, as_json: bool) -> None:
    print()
    print("| prompt tokens | KV MB | mode | prefill ms | prefill end -> decode ready ms |")
    print("|---|---|---|---|---|")
    for tokens in LAYERWISE_TOKENS:
        for stream in (False, True):
            r = run_layerwise(tokens, stream, repeats)
            print(
                f"| {r.tokens} | {r.mbytes:.0f} | {r.mode} | {r.prefill_ms:.0f} | {r.end_to_ready_ms:.1f} |",
                flush=True,
            )
            if as_json:
                print(json.dumps(asdict(r)), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="nixl,torch_dist,ray,ucx")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="1k and 8k tokens only")
    ap.add_argument("--json", action="store_true", help="print rows as JSON lines too")
    ap.add_argument("--layerwise", action="store_true", help="also the layer-wise streaming table")
    ap.add_argument("--layerwise-only", action="store_true", help="only the layer-wise streaming table")
    args = ap.parse_args(argv)
    if args.layerwise_only:
        layerwise_table(args.repeats, args.json)
        return 0
    backends = args.backends.split(",")
    sizes = [1024, 8192] if args.quick else [int(t) for t in args.tokens.split(",")]
    ray_instance = harness.local_ray() if "ray" in backends else contextlib.nullcontext()
    with ray_instance:
        return _table(args, backends, sizes)


def _table(args, backends: list[str], sizes: list[int]) -> int:
    print(
        "| layout | tokens | MB | backend | GB/s | memcpy GB/s | of memcpy | raw ms | transfer ms "
        "| export ms | hashed in prefill ms | verify ms | handover ms | handover / raw |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.layouts.split(","):
        for tokens in sizes:
            nbytes = (
                LAYOUTS[name]["num_layers"]
                * 2
                * tokens
                * LAYOUTS[name]["num_kv_heads"]
                * LAYOUTS[name]["head_dim"]
                * 2
            )
            ceiling = memcpy_gbps(nbytes, 5)
            for backend in backends:
                try:
                    r = run_one(backend, name, tokens, args.repeats, ceiling)
                except Exception as e:  # report and go on: one backend failing is a result too
                    print(
                        f"| {name} | {tokens} | | {backend} | failed: {type(e).__name__}: {e} |", flush=True
                    )
                    continue
                print(
                    f"| {r.layout} | {r.tokens} | {r.mbytes:.0f} | {r.backend} | {r.transfer_gbps:.2f} | "
                    f"{r.memcpy_gbps:.2f} | {r.of_memcpy:.0%} | {r.raw_ms:.1f} | {r.transfer_ms:.1f} | "
                    f"{r.export_ms:.1f} | "
                    f"{r.hashed_in_prefill_ms:.1f} | {r.verify_ms:.1f} | {r.handover_ms:.1f} | "
                    f"{r.handover_ratio:.2f}x |",
                    flush=True,
                )
                if args.json:
                    print(json.dumps(asdict(r)), file=sys.stderr, flush=True)
    if args.layerwise:
        layerwise_table(args.repeats, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
