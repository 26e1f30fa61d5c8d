"""Disaggregated on one machine, without Ray: a prefill engine in a second process
exports each prompt's KV layer by layer over NIXL; a decode engine here pulls it
(checksums verified per layer), takes the first token from the prefill side and
decodes on; its greedy tokens must equal one monolithic engine's.

    python -m splitserve.bench.disagg_check [--device auto|cuda|cpu] [--json PATH]

On a GPU both engines, their KV caches and the transfer live in GPU memory (NIXL
registers it; nothing is staged through the host); without CUDA the same runs on
the CPU (float32, NIXL over host memory), which is how the suite keeps it from
rotting between GPU runs. Rows: a Llama-shaped dense model, a Mixtral-shaped MoE
and a DeepSeek-V3-shaped MLA + MoE model (tiny, random weights,
``bench.tiny_models``), each with the model's KV dtype and with an FP8 KV cache
(its scales handed over in the handshake; MLA does not run with FP8 KV yet).
The source is ``bench.kv_peers``'s process, the same the KV transfer tests use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from splitserve.bench.kv_peers import Prefill, SourceProcess, SourceSpec, Streaming
from splitserve.bench.tiny_models import make_hf_checkpoint
from splitserve.engine.engine import Engine
from splitserve.kv_transfer import get_backend
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams

MODELS = ("llama", "mixtral", "deepseek_v3")
KV_DTYPES = ("auto", "fp8")
PROMPT_LENGTHS = (5, 40, 120)
MAX_TOKENS = 12
PULL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Row:
    model: str
    kv_cache_dtype: str
    device: str
    requests: int
    equal: bool  # every request's tokens equal the monolithic engine's
    streamed: bool  # the exports were pulled before the prefill's forward pass ended
    kv_bytes: int  # what crossed, all requests
    seconds: float
    error: str = ""


def rows(models=MODELS, kv_dtypes=KV_DTYPES) -> list[tuple[str, str]]:
    """The (model, KV dtype) pairs that run (MLA has no FP8 KV cache yet)."""
    return [(m, kv) for m in models for kv in kv_dtypes if not (m == "deepseek_v3" and kv == "fp8")]


def check(model: str, kv_cache_dtype: str, device: str, workdir: Path) -> Row:
    """One row: the prompts prefilled in the source process, pulled, decoded here."""
    t0 = time.perf_counter()
    directory = workdir / model
    if not (directory / "config.json").exists():
        make_hf_checkpoint(model, directory)
    config = EngineConfig(
        model=str(directory),
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_mib=64,
        block_size=16,
    )
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = [c.token_ids for c in Engine(config).generate(prompts, params)]
    try:
        with contextlib.ExitStack() as stack:
            got, streamed, kv_bytes = _disaggregated(config, prompts, params, model, stack)
    except Exception as e:  # the row says what failed; the other rows still run
        return Row(model, kv_cache_dtype, device, len(prompts), False, False, 0, _since(t0), repr(e))
    return Row(model, kv_cache_dtype, device, len(prompts), got == reference, streamed, kv_bytes, _since(t0))


def _disaggregated(config: EngineConfig, prompts, params, model: str, stack: contextlib.ExitStack):
    """(each request's tokens, whether its KV streamed, the KV bytes that crossed)."""
    decode = Engine(config)
    source = SourceProcess(SourceSpec("nixl", worker_id=f"prefill-{model}", engine=config))
    stack.callback(source.stop)
    sink = get_backend("nixl").sink("decode-0", decode.kv_cache.tensor, decode.kv_compat())
    stack.callback(sink.close)
    sink.connect(source.handshake)
    source.send(Prefill(prompts, params, stream=True))
    first = source.receive()
    streamed = isinstance(first, Streaming)
    descriptors = first.descriptors if streamed else [e.descriptor for e in first]
    prompt_of = dict(zip((d.request_id for d in descriptors), prompts, strict=True))
    for desc in descriptors:  # pulled as soon as published: layers land as they are computed
        blocks = decode.import_request(desc.request_id, prompt_of[desc.request_id], [], params)
        sink.pull(desc, blocks, timeout=PULL_TIMEOUT_S)
    exported = source.receive() if streamed else first
    for e in exported:
        decode.activate(e.descriptor.request_id, e.output_token_ids)
    decoded: dict[str, list[int]] = {}
    while decode.has_unfinished():
        for out in decode.step():
            decoded.setdefault(out.request_id, []).extend(out.new_token_ids)
    got = [e.output_token_ids + decoded[e.descriptor.request_id] for e in exported]
    return got, streamed, sum(d.num_bytes for d in descriptors)


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--kv", nargs="+", default=list(KV_DTYPES), choices=list(KV_DTYPES))
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows here as JSON")
    args = ap.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="disagg-check-") as tmp:
        results = []
        for m, kv in rows(args.models, args.kv):
            results.append(check(m, kv, device, Path(tmp)))
            if args.json:  # as it goes: a run stopped at its bound still shows the rows it did
                Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    print("| model | KV | device | requests | tokens equal | streamed | KV MB | s | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.model} | {r.kv_cache_dtype} | {r.device} | {r.requests} | {r.equal} | {r.streamed} "
            f"| {r.kv_bytes / 1e6:.2f} | {r.seconds:.1f} | {r.error} |"
        )
    return 0 if all(r.equal for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
