"""Engine benchmark: splitserve's engine against transformers' ``generate`` on the
same model, machine and dtype, measured in one run (ratios, not absolutes, are
what carry across noisy shared machines).

Workloads (all greedy, fixed lengths with ``ignore_eos``):

- decode: batch B of random-token prompts of ``--input-len`` tokens, each
  generating ``--output-len`` tokens: output tokens/s over the whole run
  (end-to-end), and over the decode phase alone (the run's time minus the time
  of the same run with one output token, i.e. its prefill);
- prefill: ``--prefill-batch`` prompts of ``--prefill-len`` tokens, one output
  token; prompt tokens/s;
- mixed: ``--mixed`` requests with prompts of 32-1024 and outputs of 16-256
  tokens (seeded): the engine batches them continuously; transformers runs
  them in arrival order in left-padded batches of ``--hf-batch`` (each batch
  runs to its longest output); useful output tokens/s.

Plus the accuracy of each dtype against float32 (the engine's own float32 run):
greedy agreement over chat prompts and the cosine of last-position logits.

    python -m splitserve.bench.engine_bench              # full run, ~15 min on 2 cores
    python -m splitserve.bench.engine_bench --quick      # smaller, ~4 min
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

from splitserve.engine.engine import Engine
from splitserve.engine.model.loader import resolve_source
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams


@dataclass
class Row:
    dtype: str
    workload: str
    unit: str
    splitserve: float
    transformers: float

    @property
    def ratio(self) -> float:
        return self.splitserve / self.transformers if self.transformers else float("nan")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def engine_run(engine: Engine, prompts: list[list[int]], outputs: list[int]) -> float:
    def run():
        for p, n in zip(prompts, outputs):
            engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()

    return timed(run)


def hf_run(model, prompts: list[list[int]], max_new: int, pad_id: int) -> float:
    """One left-padded batch through transformers' generate, exactly ``max_new`` tokens each."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run():
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
            )

    return timed(run)


def bench_dtype(dtype: str, args, rows: list[Row]) -> None:
    from transformers import AutoModelForCausalLM

    source = resolve_source(args.model)
    log(f"== {dtype}: loading splitserve engine and transformers model")
    engine = Engine(
        EngineConfig(
            model=args.model, dtype=dtype, max_num_batched_tokens=args.budget, enable_prefix_caching=False
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(str(source.directory), dtype=getattr(torch, dtype)).eval()
    vocab = engine.model_config.vocab_size
    pad = engine.tokenizer.eos_token_id if engine.tokenizer else 0
    rng = random.Random(0)
    warm = [random_prompt(rng, 64, vocab) for _ in range(2)]
    engine_run(engine, warm, [4, 4])
    hf_run(hf, warm, 4, pad)

    for b in args.batches:
        prompts = [random_prompt(rng, args.input_len, vocab) for _ in range(b)]
        n_out = args.output_len
        t_engine = engine_run(engine, prompts, [n_out] * b)
        t_hf = hf_run(hf, prompts, n_out, pad)
        # Decode phase alone: the same run with one output token is its prefill.
        t_engine_1 = engine_run(engine, prompts, [1] * b)
        t_hf_1 = hf_run(hf, prompts, 1, pad)
        shape = f"batch {b} ({args.input_len} in / {n_out} out)"
        e2e = b * n_out
        dec = b * (n_out - 1)
        rows.append(Row(dtype, f"end-to-end {shape}", "output tok/s", e2e / t_engine, e2e / t_hf))
        rows.append(
            Row(
                dtype,
                f"decode phase {shape}",
                "output tok/s",
                dec / (t_engine - t_engine_1),
                dec / (t_hf - t_hf_1),
            )
        )
        for r in rows[-2:]:
            log(f"   {r.workload}: {r.splitserve:.0f} vs {r.transformers:.0f}")

    prompts = [random_prompt(rng, args.prefill_len, vocab) for _ in range(args.prefill_batch)]
    t_engine = engine_run(engine, prompts, [1] * len(prompts))
    t_hf = hf_run(hf, prompts, 1, pad)
    n = args.prefill_len * len(prompts)
    rows.append(
        Row(
            dtype,
            f"prefill {len(prompts)} x {args.prefill_len} tokens",
            "prompt tok/s",
            n / t_engine,
            n / t_hf,
        )
    )
    log(f"   {rows[-1].workload}: {rows[-1].splitserve:.0f} vs {rows[-1].transformers:.0f}")

    mrng = random.Random(1)
    lens = [(mrng.randint(32, 1024), mrng.randint(16, 256)) for _ in range(args.mixed)]
    prompts = [random_prompt(mrng, i, vocab) for i, _ in lens]
    outs = [o for _, o in lens]
    t_engine = engine_run(engine, prompts, outs)
    t_hf = 0.0
    for i in range(0, len(prompts), args.hf_batch):
        t_hf += hf_run(hf, prompts[i : i + args.hf_batch], max(outs[i : i + args.hf_batch]), pad)
    n = sum(outs)
    rows.append(
        Row(
            dtype,
            f"mixed {args.mixed} requests (32-1024 in / 16-256 out)",
            "output tok/s",
            n / t_engine,
            n / t_hf,
        )
    )
    log(f"   {rows[-1].workload}: {rows[-1].splitserve:.0f} vs {rows[-1].transformers:.0f}")
    del hf, engine


CHATS = [
    "What is the capital of France?",
    "Write a short poem about autumn.",
    "Explain how a bicycle works.",
    "Give me three tips for learning a language.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I boil an egg?",
    "Why is the ocean salty?",
]


def accuracy_vs_float32(args) -> dict[str, dict[str, float]]:
    """Greedy agreement and logits cosine of each non-float32 dtype against float32."""
    results = {}
    ref = Engine(EngineConfig(model=args.model, dtype="float32"))
    prompts = [ref.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(max_tokens=64)
    ref_out = [o.token_ids for o in ref.generate(prompts, params)]
    ref_logits = _last_logits(ref, prompts)
    for dtype in args.dtypes:
        if dtype == "float32":
            continue
        eng = Engine(EngineConfig(model=args.model, dtype=dtype))
        out = [o.token_ids for o in eng.generate(prompts, params)]
        agree = sum(common_prefix(a, b) for a, b in zip(out, ref_out)) / sum(len(r) for r in ref_out)
        identical = sum(a == b for a, b in zip(out, ref_out)) / len(out)
        cos = torch.nn.functional.cosine_similarity(_last_logits(eng, prompts), ref_logits, dim=-1)
        results[dtype] = {
            "greedy_prefix_agreement": agree,
            "identical_outputs": identical,
            "min_logits_cosine": cos.min().item(),
            "mean_logits_cosine": cos.mean().item(),
        }
    return results


def _last_logits(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of each prompt's last position, through the engine's own model."""
    rows = []
    for p in prompts:
        captured: list[torch.Tensor] = []
        hook = engine.model.lm_head.register_forward_hook(lambda m, i, o, c=captured: c.append(o))
        engine.generate([p], SamplingParams(max_tokens=1))
        hook.remove()
        rows.append(captured[-1][-1].float())
    return torch.stack(rows)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--mixed", type=int, default=64, help="requests in the mixed workload")
    ap.add_argument(
        "--hf-batch", type=int, default=16, help="transformers' batch size for the mixed workload"
    )
    ap.add_argument("--budget", type=int, default=2048, help="engine token budget per step")
    ap.add_argument("--quick", action="store_true", help="batches 1,64; 32 mixed requests; 64 output tokens")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.batches, args.mixed, args.output_len = [1, 64], 32, 64
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows: list[Row] = []
    for dtype in args.dtypes:
        bench_dtype(dtype, args, rows)
    accuracy = accuracy_vs_float32(args)

    print("| dtype | workload | unit | splitserve | transformers | ratio |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.dtype} | {r.workload} | {r.unit} | {r.splitserve:.0f} | {r.transformers:.0f} | "
            f"{r.ratio:.2f}x |"
        )
    for dtype, acc in accuracy.items():
        print(
            f"\n{dtype} vs float32 (engine, 8 chat prompts, 64 greedy tokens): "
            f"greedy agreement {acc['greedy_prefix_agreement']:.1%} of tokens before first divergence, "
            f"{acc['identical_outputs']:.0%} outputs identical, "
            f"last-position logits cosine min {acc['min_logits_cosine']:.4f} "
            f"mean {acc['mean_logits_cosine']:.4f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rows": [asdict(r) | {"ratio": r.ratio} for r in rows], "accuracy": accuracy}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
