"""The KV handoff's bandwidth against a copy of the same bytes on the same device.

    python -m splitserve.bench.handoff_check [--device auto|cuda|cpu] [--tokens 4096 32768] [--json PATH]

A source process (``bench.kv_peers``) holds a bare KV pool of Llama-3-8B's
shape (32 layers x 8 KV heads x 128, bfloat16, 16-token blocks: 128 KiB per
token, 512 MiB at 4k tokens, 4 GiB at 32k) filled with random bytes, and
exports one request's blocks with their layer checksums; this process pulls
them over NIXL into a pool of its own. On a GPU both pools are GPU memory
(NIXL registers them as VRAM; UCX moves them GPU to GPU, nothing staged
through the host) and the checksums are computed on the device
(``kv_transfer.device_hash``, no host copy); without CUDA both are host memory.
Per size, the median of ``--repeats`` pulls after one that sets up the connection:

- transfer GB/s: the bytes over the time spent moving them (``TransferStats.transfer_s``);
- pull GB/s: the bytes over the whole pull (moved and verified);
- copy GB/s: ``copy_`` of as many bytes between two buffers on the device
  (best of ``--repeats``), measured in the same run: the ceiling;
- of copy: transfer GB/s / copy GB/s (the goal on a GPU: >= 0.5 at 32k tokens).
- verify, hash, confirm, other ms: the pull's time beside the transfer: waiting for the
  checksums after the last chunk, queuing them during the pull, telling the source, the rest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from splitserve.bench.kv_peers import Confirm, ExportRandom, SourceProcess, SourceSpec
from splitserve.kv_transfer import get_backend
from splitserve.wire.kv import CompatInfo, checksum_kind
from splitserve.wire.kv_layout import KVLayout

LLAMA_3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)
BLOCK = 16
PULL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Row:
    tokens: int
    device: str
    mbytes: float
    transfer_gbps: float
    pull_gbps: float
    copy_gbps: float
    of_copy: float
    verify_ms: float
    hash_ms: float  # queuing the checksums of moved layers (during the pull)
    confirm_ms: float
    other_ms: float  # the rest of the pull: checks, set-up


def copy_gbps(nbytes: int, device: torch.device, repeats: int) -> float:
    """``copy_`` between two ``nbytes`` buffers on ``device``, best of ``repeats``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (and first touch on the host)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(tokens: int, device: torch.device, repeats: int) -> Row:
    """One size: a source process exporting ``tokens`` tokens' blocks, pulled here."""
    nblocks = -(-tokens // BLOCK)
    layout = KVLayout(num_blocks=nblocks, block_size=BLOCK, dtype="bfloat16", **LLAMA_3_8B)
    source = SourceProcess(SourceSpec("nixl", layout=layout, device=str(device)))
    try:
        shape = (layout.num_layers, 2, nblocks, BLOCK, layout.num_kv_heads, layout.head_dim)
        cache = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        compat = CompatInfo(model="random", layout=layout, checksum=checksum_kind(device.type))
        sink = get_backend("nixl").sink("handoff-check", cache, compat)
        sink.connect(source.handshake)
        samples = []
        try:
            for _ in range(repeats + 1):  # the first pull also sets up the connection: not counted
                exported = source.call(ExportRandom(num_tokens=tokens))
                confirmation = sink.pull(exported.descriptor, list(range(nblocks)), timeout=PULL_TIMEOUT_S)
                if not confirmation.delivered:
                    source.call(Confirm(confirmation.transfer_id))
                st = sink.last_stats
                samples.append((st.transfer_s, st.total_s, st.verify_s, st.hash_s, st.confirm_s))
        finally:
            sink.close()
    finally:
        source.stop()
    nbytes = exported.descriptor.num_bytes
    transfer_s, total_s, verify_s, hash_s, confirm_s = (statistics.median(x) for x in zip(*samples[1:]))
    ceiling = copy_gbps(nbytes, device, repeats)
    transfer = nbytes / transfer_s / 1e9
    return Row(
        tokens,
        str(device),
        nbytes / 1e6,
        transfer,
        nbytes / total_s / 1e9,
        ceiling,
        transfer / ceiling,
        verify_s * 1e3,
        hash_s * 1e3,
        confirm_s * 1e3,
        (total_s - transfer_s - verify_s - hash_s - confirm_s) * 1e3,
    )


def markdown(rows: list[Row]) -> str:
    lines = [
        "| tokens | device | MB | transfer GB/s | pull GB/s | copy GB/s | of copy | verify ms "
        "| hash ms | confirm ms | other ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.tokens} | {r.device} | {r.mbytes:.0f} | {r.transfer_gbps:.1f} | {r.pull_gbps:.1f} "
            f"| {r.copy_gbps:.1f} | {r.of_copy:.2f} | {r.verify_ms:.1f} | {r.hash_ms:.1f} "
            f"| {r.confirm_ms:.1f} | {r.other_ms:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 32768])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows here as JSON")
    args = ap.parse_args(argv)
    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    rows = []
    for tokens in args.tokens:  # the JSON is rewritten per size: a caller's timeout keeps the rows done
        rows.append(measure(tokens, device, args.repeats))
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
