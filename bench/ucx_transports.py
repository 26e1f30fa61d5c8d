"""Why a GPU-to-GPU KV handoff is slow on a given machine: whether two processes can
share GPU memory at all (CUDA IPC), and what UCX chooses under each transport set.

    python -m splitserve.bench.ucx_transports [--tokens 4096] [--tls cuda_copy,cuda_ipc,tcp,self ...]

1. **CUDA IPC**: a child process receives a CUDA tensor through
   ``torch.multiprocessing`` (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``,
   what UCX's ``cuda_ipc`` transport uses) and sums it. If this fails, no UCX
   setting can move VRAM between processes without staging it.
2. **Shared memory**: the size of ``/dev/shm`` (UCX's ``sm``/``posix`` transports).
3. **The handoff under each ``UCX_TLS``**: ``bench.handoff_check`` at ``--tokens``
   in a process of its own (bounded by ``--timeout``), with ``UCX_PROTO_INFO=y`` so
   UCX prints the protocol it picked for each transfer; the GB/s and UCX's tables
   for reads into GPU memory (the pull) are printed, its whole output written to
   ``--out`` when given (``--env UCX_LOG_LEVEL=debug`` says why a transport was
   left out).

Needs CUDA and NIXL. A diagnostic for deployers and for ``docs/gpu.md``; the
handoff's own figures come from ``bench.handoff_check``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

DEFAULT_TLS = ("cuda_copy,cuda_ipc,tcp,self", "cuda_copy,cuda_ipc,sm,self", "all")


def _child_sum(queue, out) -> None:  # in the child: the parent's CUDA tensor, opened by IPC handle
    t = queue.get()
    out.put(float(t.sum().item()))


def cuda_ipc_works(timeout_s: float = 60.0) -> str:
    """'yes', or the reason a child could not read the parent's CUDA tensor."""
    ctx = mp.get_context("spawn")
    queue, out = ctx.Queue(), ctx.Queue()
    t = torch.ones(1 << 20, device="cuda")
    child = ctx.Process(target=_child_sum, args=(queue, out), daemon=True)
    child.start()
    try:
        queue.put(t)
        total = out.get(timeout=timeout_s)
    except Exception as e:  # noqa: BLE001  (the probe reports, whatever failed)
        return f"no: {type(e).__name__}: {e}"
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    return "yes" if total == t.numel() else f"no: the child read a sum of {total}, not {t.numel()}"


def handoff_under(
    tls: str,
    tokens: int,
    timeout_s: float,
    out_dir: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> tuple[str, list[str]]:
    """(the handoff's row as JSON or the failure, UCX's protocol lines) with ``UCX_TLS=tls``
    (and ``extra_env``); UCX's whole output goes to ``out_dir`` when given."""
    env = {**os.environ, "UCX_PROTO_INFO": "y", **(extra_env or {})}
    if tls != "all":
        env["UCX_TLS"] = tls
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "splitserve.bench.handoff_check", "--device", "cuda"]
        cmd += ["--tokens", str(tokens), "--repeats", "1", "--json", str(rows)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout_s:.0f} s", []
        text = proc.stdout + proc.stderr
        if out_dir is not None:  # UCX's whole report, for reading after the call
            (out_dir / f"ucx_{tls.replace(',', '-')}.log").write_text(text)
        protocols = reads_into_gpu(text.splitlines())
        if rows.exists():
            return json.dumps(json.loads(rows.read_text())), protocols
        return f"failed (rc {proc.returncode}): {text.strip().splitlines()[-1:] or ['']}", protocols


def reads_into_gpu(lines: list[str], after: int = 5) -> list[str]:
    """UCX_PROTO_INFO's tables for remote reads into GPU memory (the handoff's pull):
    each header and the rows after it, which name the transport each size range uses."""
    picked: list[str] = []
    for i, line in enumerate(lines):
        if "remote memory read" in line and "into cuda" in line:
            picked.extend(x.strip() for x in lines[i : i + 1 + after])
    return picked[:24]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--tls", nargs="+", default=list(DEFAULT_TLS), help="UCX_TLS values ('all': unset)")
    ap.add_argument("--timeout", type=float, default=45.0, help="seconds per handoff run")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="more UCX settings, every run")
    ap.add_argument("--out", type=Path, default=None, help="a folder for UCX's whole output per run")
    args = ap.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.env)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        raise SystemExit("ucx_transports needs a CUDA device")
    print(f"CUDA IPC between processes: {cuda_ipc_works()}")
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    print(f"/dev/shm: {f'{shm.total / 2**20:.0f} MiB' if shm else 'absent'}")
    for tls in args.tls:
        row, protocols = handoff_under(tls, args.tokens, args.timeout, args.out, extra)
        print(f"UCX_TLS={tls}: {row}")
        for line in protocols:
            print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
