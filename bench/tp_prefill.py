"""Prefill throughput under tensor parallelism against TP=1, in one run.

    python -m splitserve.bench.tp_prefill [--tp 2] [--tokens 2048] [--threads 1]

A random-weight Llama (``--hidden``, ``--layers``; heads and MLP sized like
Llama's) prefills ``--prompts`` prompts of ``--tokens`` tokens each (one output
token, prefix cache off), first as one process (TP=1), then as ``--tp``
processes over torch.distributed (gloo on CPU, NCCL on GPUs), each process
with ``--threads`` torch threads. Prints prompt tokens/s for both and the
ratio. On this project's 2-core CPU machine, TP=2 with 1 thread per rank is
compared with TP=1 with 1 thread: the ideal ratio is 2.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time
from dataclasses import dataclass

import torch

from splitserve.engine.engine import Engine
from splitserve.engine.parallel.group import TPGroup
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from splitserve.wire.tp import TPInit


@dataclass(frozen=True)
class Case:
    hidden: int
    layers: int
    tokens: int
    prompts: int
    threads: int
    device: str


def hf_config(case: Case):
    from transformers import LlamaConfig

    heads = case.hidden // 128
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=case.hidden,
        intermediate_size=int(case.hidden * 3.5) // 256 * 256,
        num_hidden_layers=case.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=max(4096, case.tokens),
    )


def engine_config(case: Case, tp_size: int) -> EngineConfig:
    return EngineConfig(
        model="random",
        random_weights=True,
        dtype="bfloat16" if case.device == "cuda" else "auto",
        device=case.device,
        tp_size=tp_size,
        enable_prefix_caching=False,
        max_num_batched_tokens=case.tokens,
        num_kv_blocks=case.prompts * (-(-case.tokens // 16)) + 16,
    )


def prefill_tokens_per_s(engine: Engine, case: Case) -> float:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (case.tokens,), generator=g).tolist() for _ in range(case.prompts)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate(prompts[:1], params)  # warm-up
    if case.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    if case.device == "cuda":
        torch.cuda.synchronize()
    return case.prompts * case.tokens / (time.perf_counter() - t0)


def _rank(case: Case, init: TPInit, out) -> None:
    torch.set_num_threads(case.threads)
    if case.device == "cuda":
        torch.cuda.set_device(init.rank)
    group = TPGroup.join(init, torch.device(case.device))
    engine = Engine(engine_config(case, init.size), hf_config=hf_config(case), tp=group)
    try:
        if group.is_driver:
            out.put(prefill_tokens_per_s(engine, case))
            engine.stop_followers()
        else:
            engine.follow()
    finally:
        group.destroy()


def tp_tokens_per_s(case: Case, tp: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    address = f"tcp://127.0.0.1:{port}"
    procs = [ctx.Process(target=_rank, args=(case, TPInit(r, tp, address), out)) for r in range(tp)]
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join(60)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per prompt")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    case = Case(args.hidden, args.layers, args.tokens, args.prompts, args.threads, args.device)
    torch.set_num_threads(case.threads)
    base = prefill_tokens_per_s(Engine(engine_config(case, 1), hf_config=hf_config(case)), case)
    tp = tp_tokens_per_s(case, args.tp)
    print(
        f"prefill {case.prompts} x {case.tokens} tokens, hidden {case.hidden}, {case.layers} layers, "
        f"{case.device}, {case.threads} thread(s) per process"
    )
    print(f"TP=1: {base:8.0f} tok/s")
    print(f"TP={args.tp}: {tp:8.0f} tok/s  ({tp / base:.2f}x)")


if __name__ == "__main__":
    main()
