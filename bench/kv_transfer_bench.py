"""KV transfer benchmark: bandwidth per backend against this machine's
single-thread memcpy (the ceiling), and handover time against raw transfer time.

For each layout (SmolLM2-135M: 30 layers x 3 KV heads x 64, and a
Llama-3-8B-shaped one: 32 x 8 x 128; bfloat16, 16-token blocks) and each KV
size (1k, 8k, 32k tokens), a source process (``kv_peers``) holds a pool of
random bytes and exports one request's blocks; this process pulls them into
its own pool. Per backend, the median of ``--repeats`` pulls of:

- transfer: moving the bytes into place (``TransferStats.transfer_s``), as GB/s
  and as a fraction of memcpy of the same bytes measured in the same run;
- handover: export (hashing + publishing, timed in the source) + pull (transfer
  + verify): from "prefill done" to "decode may start", and its ratio to the
  raw transfer.

    python -m splitserve.bench.kv_transfer_bench                  # everything, ~10 min
    python -m splitserve.bench.kv_transfer_bench --quick          # 1k and 8k only
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from splitserve.bench.kv_peers import Confirm, ExportRandom, SourceSpec, start_source
from splitserve.engine import KVLayout
from splitserve.engine.kv_cache import allocate_zeros
from splitserve.kv_transfer import CompatInfo, get_backend

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
    transfer_ms: float
    export_ms: float
    verify_ms: float
    handover_ms: float
    handover_ratio: float


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """Single-thread libc memcpy between two pre-faulted buffers allocated like the KV
    pools (huge pages where available), best of ``repeats``."""
    src = allocate_zeros((nbytes,), torch.uint8).fill_(1)  # the same pages as the KV pools
    dst = allocate_zeros((nbytes,), torch.uint8)
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
        for _ in range(repeats + 1):  # the first pull also sets up the connection: not counted
            exp = src.call(ExportRandom(num_tokens=tokens))
            conf = sink.pull(exp.descriptor, list(range(nblocks)), timeout=120.0)
            if not conf.delivered:
                src.call(Confirm(conf.transfer_id))
            st = sink.last_stats
            samples.append((st.transfer_s, exp.export_s, st.verify_s, exp.export_s + st.total_s))
        sink.close()
    finally:
        src.stop()
    transfer, export, verify, handover = (statistics.median(x) for x in zip(*samples[1:]))
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
        transfer * 1e3,
        export * 1e3,
        verify * 1e3,
        handover * 1e3,
        handover / transfer,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="nixl,torch_dist,ray")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1k and 8k tokens only")
    ap.add_argument("--json", action="store_true", help="print rows as JSON lines too")
    args = ap.parse_args(argv)
    backends = args.backends.split(",")
    sizes = [1024, 8192] if args.quick else [int(t) for t in args.tokens.split(",")]
    if "ray" in backends:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(
        "| layout | tokens | MB | backend | GB/s | memcpy GB/s | of memcpy | transfer ms | export ms "
        "| verify ms | handover ms | handover / transfer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
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
                    f"{r.memcpy_gbps:.2f} | {r.of_memcpy:.0%} | {r.transfer_ms:.1f} | {r.export_ms:.1f} | "
                    f"{r.verify_ms:.1f} | {r.handover_ms:.1f} | {r.handover_ratio:.2f}x |",
                    flush=True,
                )
                if args.json:
                    print(json.dumps(asdict(r)), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
