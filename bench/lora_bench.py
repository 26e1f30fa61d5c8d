"""Multi-LoRA's cost in the engine (``engine.lora``): a batch of requests spread over
several adapters against the same batch on the base model, same engine build, same
run, fresh engines alternated.

Rows (output tokens/s, greedy, ``--batch`` prompts of ``--input-len`` tokens each
generating ``--output-len``):

- base: an engine without LoRA, every request on the base model (the baseline);
- lora, base requests: an engine with the adapters loaded, every request on the base
  (what wrapping the projections costs a batch that uses none);
- lora, mixed: the same engine, the requests spread round-robin over ``--adapters``
  adapters of rank ``--rank`` on all seven projections (the issue's row).

    python -m splitserve.bench.lora_bench                 # SmolLM2, 32 x 4 adapters
    python -m splitserve.bench.lora_bench --rounds 3 --batch 32 --adapters 4 --rank 16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from splitserve.engine.engine import Engine
from splitserve.engine.lora import TARGETS
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams


def write_adapter(directory: Path, engine: Engine, rank: int, seed: int, scale: float = 0.01) -> None:
    """A random PEFT LoRA adapter of ``engine``'s model (all seven projections, rank
    ``rank``, weights of standard deviation ``scale``), in PEFT's file layout, shaped
    from the model's own config."""
    mc = engine.model_config
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes = {
        "self_attn.q_proj": (mc.hidden_size, q),
        "self_attn.k_proj": (mc.hidden_size, kv),
        "self_attn.v_proj": (mc.hidden_size, kv),
        "self_attn.o_proj": (q, mc.hidden_size),
        "mlp.gate_proj": (mc.hidden_size, mc.intermediate_size),
        "mlp.up_proj": (mc.hidden_size, mc.intermediate_size),
        "mlp.down_proj": (mc.intermediate_size, mc.hidden_size),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (directory / "adapter_config.json").write_text(json.dumps(config))


def run(engine: Engine, prompts: list[list[int]], adapters: list[str | None], output_len: int) -> float:
    """Output tokens/s of the whole batch, to completion."""
    started = time.perf_counter()
    for prompt, adapter in zip(prompts, adapters):
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, adapter=adapter))
    while engine.has_unfinished():
        engine.step()
    return len(prompts) * output_len / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    common = dict(model=args.model, dtype=args.dtype, kv_cache_memory_mib=512, enable_prefix_caching=False)
    base = Engine(EngineConfig(**common))
    rng = random.Random(0)
    vocab = base.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.batch)]
    names = [f"a{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, base, args.rank, seed=i)
        lora_cfg = dict(common, enable_lora=True, max_lora_rank=args.rank)
        lora_cfg["lora_modules"] = {n: str(Path(tmp) / n) for n in names}
        lora = Engine(EngineConfig(**lora_cfg))
    mixed = [names[i % len(names)] for i in range(args.batch)]
    rows: dict[str, list[float]] = {"base": [], "lora, base requests": [], "lora, mixed": []}
    run(base, prompts[:2], [None, None], 4)  # warm both
    run(lora, prompts[:2], names[:2], 4)
    for r in range(args.rounds):
        rows["base"].append(run(base, prompts, [None] * args.batch, args.output_len))
        rows["lora, base requests"].append(run(lora, prompts, [None] * args.batch, args.output_len))
        rows["lora, mixed"].append(run(lora, prompts, mixed, args.output_len))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()), file=sys.stderr)
    rounds = ", ".join(f"{m / b:.2f}x" for m, b in zip(rows["lora, mixed"], rows["base"]))
    print(f"mixed / base by round: {rounds}", file=sys.stderr)
    best = {k: max(v) for k, v in rows.items()}
    print(
        f"{args.model} ({base.dtype}), {args.batch} x {args.input_len}/{args.output_len}, "
        f"{args.adapters} adapters of rank {args.rank} on all seven projections; best of {args.rounds}"
    )
    print(f"{'row':<22} {'tok/s':>8} {'vs base':>8}")
    for k, v in best.items():
        print(f"{k:<22} {v:>8.1f} {v / best['base']:>7.2f}x")


if __name__ == "__main__":
    main()
