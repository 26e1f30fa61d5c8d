"""What a mixture-of-experts decode step costs on this CPU, against a dense model of
the same active parameters, and the grouped expert kernel against a per-expert loop;
all in one run (ratios carry across machines, absolutes do not).

    python -m splitserve.bench.moe_bench                  # Qwen3-30B-A3B's shapes, 4 layers
    python -m splitserve.bench.moe_bench --layers 2 --batches 1 16

- **decode step**: a random-weight model of Qwen3-30B-A3B's shapes (hidden 2048,
  32 query / 4 KV heads of 128, 128 experts of width 768, top 8) with ``--layers``
  layers and a 32k vocabulary, bf16, beside a dense Qwen3 of the same shapes whose
  MLP is 8 x 768 = 6144 wide (the same active parameters per token). ``B`` prompts
  of ``--prompt`` tokens are prefilled, then ``--steps`` decode steps are timed.
- **expert kernel**: one MoE layer's experts (bf16) on ``T`` tokens routed by the
  real router rule: ``moe.grouped_experts`` (tokens grouped by expert, one GEMM
  pair per expert that has tokens) against the per-expert loop transformers runs
  (a token mask and ``where`` per expert, then gather, GEMMs and ``index_add``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from splitserve.engine.engine import Engine
from splitserve.engine.model.moe import grouped_experts
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams

HIDDEN, EXPERTS, TOP_K, EXPERT_WIDTH = 2048, 128, 8, 768


def qwen3_configs(layers: int):
    """(MoE, dense) transformers configs of Qwen3-30B-A3B's shapes with ``layers`` layers."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=32768,
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    moe = Qwen3MoeConfig(
        **common,
        intermediate_size=6144,
        moe_intermediate_size=EXPERT_WIDTH,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
    )
    return moe, Qwen3Config(**common, intermediate_size=TOP_K * EXPERT_WIDTH)


def decode_step_ms(hf_config, batch: int, prompt: int, steps: int) -> float:
    """Median ms of one decode step at ``batch`` running sequences."""
    cfg = EngineConfig(
        model="bench",
        random_weights=True,
        dtype="bfloat16",
        kv_cache_memory_mib=1024,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * prompt),
        enable_prefix_caching=False,
    )
    engine = Engine(cfg, hf_config)
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        ids = torch.randint(100, hf_config.vocab_size, (prompt,), generator=g).tolist()
        engine.add_request(ids, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    engine.step()  # the prefill of every prompt (one chunk)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def looped_experts(x, gate_up, down, weights, ids):
    """transformers' expert loop (``MixtralExperts.forward``): a mask per expert hit."""
    out = torch.zeros_like(x)
    num = gate_up.shape[0]
    mask = F.one_hot(ids, num_classes=num).permute(2, 1, 0)
    inter = down.shape[2]
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = e[0]
        pos, tok = torch.where(mask[e])
        h = F.linear(x[tok], gate_up[e])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down[e]) * weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def kernel_ms(tokens: int, repeats: int) -> tuple[float, float]:
    """(grouped, looped) median ms for one layer's experts on ``tokens`` tokens."""
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(EXPERTS, 2 * EXPERT_WIDTH, HIDDEN, generator=g) * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, EXPERT_WIDTH, generator=g) * 0.02).bfloat16()
    router = torch.randn(EXPERTS, HIDDEN, generator=g) * 0.02
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    probs = F.linear(x.float(), router).softmax(-1)
    weights, ids = probs.topk(TOP_K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = []
    for fn in (grouped_experts, looped_experts):
        fn(x, gate_up, down, weights, ids)  # warm up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(x, gate_up, down, weights, ids)
            times.append(time.perf_counter() - t0)
        times.sort()
        out.append(times[len(times) // 2] * 1e3)
    a, b = grouped_experts(x, gate_up, down, weights, ids), looped_experts(x, gate_up, down, weights, ids)
    error = (a.float() - b.float()).norm() / b.float().norm()
    if error > 1e-2:  # bf16 rounding differs between the two; a wrong sum is off by far more
        raise AssertionError(f"the grouped kernel and the loop disagree (relative error {error:.3g})")
    return out[0], out[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kernel-tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16")
    print(f"\nexpert kernel, one layer ({EXPERTS} experts of {EXPERT_WIDTH}, top {TOP_K}, hidden {HIDDEN})")
    print(f"{'tokens':>7} {'grouped ms':>11} {'loop ms':>9} {'loop/grouped':>13}")
    for t in args.kernel_tokens:
        grouped, looped = kernel_ms(t, repeats=5)
        print(f"{t:>7} {grouped:>11.2f} {looped:>9.2f} {looped / grouped:>12.2f}x")
    moe, dense = qwen3_configs(args.layers)
    print(f"\ndecode step, {args.layers} layers of Qwen3-30B-A3B's shapes vs a dense model of the same "
          f"active parameters (MLP {TOP_K * EXPERT_WIDTH} wide), {args.prompt}-token prompts")  # fmt: skip
    print(f"{'batch':>6} {'MoE ms':>8} {'dense ms':>9} {'MoE/dense':>10}")
    for b in args.batches:
        m = decode_step_ms(moe, b, args.prompt, args.steps)
        d = decode_step_ms(dense, b, args.prompt, args.steps)
        print(f"{b:>6} {m:>8.1f} {d:>9.1f} {m / d:>9.2f}x")


if __name__ == "__main__":
    main()
