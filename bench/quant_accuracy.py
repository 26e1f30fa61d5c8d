"""How close quantized models stay to the float32 reference.

    python -m splitserve.bench.quant_accuracy [--model smollm2] [--dtype auto]

For each quantization (int8 weight-only, FP8 W8A8; on CPU FP8 runs its
exact-dequantizing fallback, the same numbers FP8 tensor cores compute) and
for unquantized bf16 as a yardstick, and bf16 with an FP8 KV cache
(``kv_cache_dtype: fp8``), over a set of chat prompts:

- teacher-forced logits at every prompt position, against float32: cosine
  (mean and minimum) and top-1 agreement (the token greedy decoding would
  pick there), and the perplexity of the prompts' own next tokens;
- free-running greedy generation of ``--max-tokens`` tokens: prompts whose
  output is identical, and the mean length of the identical prefix.

With ``--speed B``, also the decode phase's output tokens/s at batch B (256-token
prompts, 64 output tokens, minus the same run with one output token), as a
ratio to unquantized bf16 measured in the same run. On GPUs use ``gpu_bench``.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch
from torch import nn

from splitserve.bench.engine_bench import common_prefix, engine_run, random_prompt
from splitserve.engine.attention import SeqSpan
from splitserve.engine.engine import Engine
from splitserve.engine.model_runner import StepInputs
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "What is 12 times 7?",
    "Give me a recipe for pancakes.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into Spanish.",
]


@dataclass
class Closeness:
    mean_cos: float
    min_cos: float
    top1: float  # teacher-forced top-1 agreement
    perplexity: float  # of the prompts' own next tokens


def prompt_logits(engine: Engine, ids: list[int], cached_prefix: int = 0) -> torch.Tensor:
    """float32 logits at every position of ``ids`` from ``cached_prefix`` on: one prefill
    into blocks 0.. of an engine with no requests (it overwrites those blocks; use a
    dedicated engine). With ``cached_prefix``, the first that many tokens are prefilled
    first, and the rest attend over them from the cache (as a chunked prompt, or a
    decode, reads them: an FP8 cache then shows its rounding). Under tensor
    parallelism, call it on the driver while the other ranks follow."""
    bs, n, c = engine.config.block_size, len(ids), cached_prefix
    blocks = list(range(-(-n // bs)))
    slots = [blocks[p // bs] * bs + p % bs for p in range(n)]
    if c:
        engine.runner.run(StepInputs(ids[:c], list(range(c)), slots[:c], [SeqSpan(0, c, c, blocks)], 0, []))
    rest = StepInputs(
        ids[c:], list(range(c, n)), slots[c:], [SeqSpan(0, n - c, n, blocks)], 0, list(range(n - c))
    )
    return engine.runner.run(rest)


def closeness(engine: Engine, reference: Engine, prompts: list[list[int]]) -> Closeness:
    cos, top1, nll = [], [], []
    for p in prompts:
        got, ref = prompt_logits(engine, p), prompt_logits(reference, p)
        cos.append(nn.functional.cosine_similarity(got, ref, dim=-1))
        top1.append((got.argmax(-1) == ref.argmax(-1)).float())
        nll.append(
            nn.functional.cross_entropy(
                got[:-1].float(), torch.tensor(p[1:], device=got.device), reduction="none"
            )
        )
    c = torch.cat(cos)
    ppl = torch.cat(nll).mean().exp().item()
    return Closeness(c.mean().item(), c.min().item(), torch.cat(top1).mean().item(), ppl)


def greedy_agreement(got: list[list[int]], ref: list[list[int]]) -> tuple[int, float]:
    """(outputs identical to the reference, mean identical-prefix length)."""
    return sum(a == b for a, b in zip(got, ref)), sum(map(common_prefix, got, ref)) / len(ref)


def decode_tokens_per_s(engine: Engine, batch: int, input_len: int = 256, output_len: int = 64) -> float:
    """Output tokens/s of the decode phase of ``batch`` random prompts (prefix cache off)."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(rng, input_len, vocab) for _ in range(batch)]
    engine_run(engine, prompts[:2], [4, 4])  # warm-up
    whole = engine_run(engine, prompts, [output_len] * batch)
    prefill = engine_run(engine, prompts, [1] * batch)
    return batch * (output_len - 1) / (whole - prefill)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto", help="compute dtype of the quantized models")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--speed", type=int, metavar="B", help="also time the decode phase at batch B")
    args = ap.parse_args(argv)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    reference = Engine(EngineConfig(model=args.model, dtype="float32", kv_cache_memory_mib=64))
    prompts = [reference.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    ref_out = [c.token_ids for c in reference.generate(prompts, params)]
    print(f"{args.model}: {len(prompts)} chat prompts, {sum(map(len, prompts))} positions, reference float32")
    speed_col = f" decode tok/s at B={args.speed} (vs bf16) |" if args.speed else ""
    ref_ppl = closeness(reference, reference, prompts).perplexity
    print(f"prompt perplexity of the float32 reference: {ref_ppl:.3f}")
    header = (
        "| variant | mean cosine | min cosine | top-1 agreement | prompt perplexity | greedy identical "
        "| identical prefix | KV bytes/token |"
    )
    print(header + speed_col)
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.speed else ""))
    variants = [
        ("bfloat16", "none", "auto"),
        ("bfloat16", "none", "fp8"),
        (args.dtype, "int8", "auto"),
        (args.dtype, "fp8", "auto"),
    ]
    baseline = None
    for dtype, q, kv in variants:
        engine = Engine(
            EngineConfig(
                model=args.model,
                dtype=dtype,
                quantization=q,
                kv_cache_dtype=kv,
                kv_cache_memory_mib=256,
                enable_prefix_caching=False,
                max_num_batched_tokens=2048,
            )
        )
        c = closeness(engine, reference, prompts)
        same, prefix = greedy_agreement([o.token_ids for o in engine.generate(prompts, params)], ref_out)
        label = f"{q} ({engine.dtype}){', fp8 KV' if kv == 'fp8' else ''}".replace("torch.", "")
        speed = ""
        if args.speed:
            tps = decode_tokens_per_s(engine, args.speed)
            baseline = baseline or tps
            speed = f" {tps:.0f} ({tps / baseline:.2f}x) |"
        print(
            f"| {label} | {c.mean_cos:.4f} | {c.min_cos:.4f} | {c.top1:.3f} | {c.perplexity:.3f} "
            f"| {same}/{len(prompts)} | {prefix:.1f}/{args.max_tokens} | {engine.capacity.bytes_per_token} |"
            + speed
        )


if __name__ == "__main__":
    main()
