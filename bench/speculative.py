"""What speculative decoding buys: decode tokens/s of the real SmolLM2 with and
without speculation (n-gram lookup; self-speculation from its first layers), at
batch 1 and 16, on a copy-heavy workload (repeat or correct a given text) and on
chat questions, in the same run.

    python -m splitserve.bench.speculative [--tokens 128] [--rounds 3] [--batches 1,16]
        [--methods ngram,self] [--draft-layers 8] [--dtype auto]

Each row runs the same prompts greedily through two engines of one config, one
speculating (``--num-tokens`` at most per step, adapted per request) and one not.
Decode tokens/s counts the tokens generated after every request of the batch has
its first one, over the time that took (prefill is the same for both). Batch 1
runs the prompts one after the other. Each round measures both; the row shows the
median ratio and the speculating engine's acceptance rate and mean accepted length
over its runs. Goal (issue 53): >= 1.5x at batch 1 on the copy-heavy workload,
never below 1.0x at batch 16.

    python -m splitserve.bench.speculative --agreement [--dtypes float32,bfloat16]
        [--tokens 64] [--batches 1,8] [--prompts 8] [--verification rows,chunk]

``--agreement`` measures exactness instead of speed (issue 70): per dtype, the same
prompts (``--prompts`` of each workload, ``batch`` at a time) decoded greedily with
and without n-gram speculation; it prints the fraction of prompts whose outputs are
identical and, for the others, the first output position that differs. ``rows``
verifies a draft as k+1 one-token decode rows (``ModelRunner.spread_drafts``: the
packing CUDA graphs replay), ``chunk`` as one k+1-token chunk through the prefill
kernel (the CPU backend's packing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from splitserve.bench import harness
from splitserve.engine.engine import Engine
from splitserve.engine.model.cpu_linear import PackedLinear
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.sampling import SamplingParams

TEXTS = [
    "The harbour town wakes early. Fishing boats leave before dawn, and by seven the market is full of "
    "crates of mackerel, crab and squid. Tourists arrive later, buy coffee on the quay and watch the "
    "gulls fight over scraps while the old men mend their nets in the sun.",
    "To reset the router, unplug it for thirty seconds, plug it back in and wait until the status light "
    "turns green. If the light stays orange, hold the reset button for ten seconds with a paper clip. "
    "Your settings will return to the factory defaults and the network name will change.",
    "Our quarterly results were better than expected. Revenue grew by twelve percent, driven by strong "
    "sales in Europe, while costs stayed flat. We will invest the extra cash in two new warehouses and "
    "in training for our support staff, who handled a record number of calls this spring.",
    "Photosynthesis turns light into chemical energy. In the leaves, chlorophyll absorbs sunlight and uses "
    "it to split water into oxygen and hydrogen. The hydrogen then combines with carbon dioxide from the "
    "air to build sugars, which the plant stores or burns for growth.",
    "The recipe is simple. Mix two cups of flour with a teaspoon of salt, add warm water slowly and knead "
    "the dough for ten minutes. Let it rest under a towel for an hour, then shape it into a round loaf "
    "and bake it at two hundred degrees until the crust is brown.",
    "The meeting is moved to Thursday at three in the afternoon, in the large room on the second floor. "
    "Please bring the draft of the report and your notes from the customer visits. We will decide on the "
    "budget for next year and choose who presents the results to the board.",
    "Mountain weather changes quickly. A clear morning can turn into fog and hail by noon, so walkers "
    "should carry a waterproof jacket, a map and enough food and water for the whole day. Tell someone "
    "where you are going and turn back early if the clouds come down.",
    "The library will be closed for repairs from the first to the fifteenth of March. Books can still be "
    "returned through the slot by the main door, and loans that end during the closure will be extended "
    "automatically. The reading room reopens with new lights and more seats.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in one sentence why the sky is blue.",
    "Write a haiku about the sea.",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a bakery.",
    "How do I boil an egg?",
]


def workload(name: str, batch: int) -> list[list[dict[str, str]]]:
    """``batch`` chats: ``copy`` asks to repeat or to correct a text (copy-heavy), ``chat``
    asks a question."""
    if name == "chat":
        return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(batch)]
    asks = [
        "Repeat this text exactly:\n\n{}",
        "Correct any mistakes in this text and write it out again:\n\n{}",
    ]
    return [
        [{"role": "user", "content": asks[(i // len(TEXTS)) % 2].format(TEXTS[i % len(TEXTS)])}]
        for i in range(batch)
    ]


def decode_rate(engine: Engine, chats: list[list[dict[str, str]]], tokens: int, batch: int) -> float:
    """Decode tokens/s of ``chats`` run ``batch`` at a time (see the module docstring)."""
    params = SamplingParams(max_tokens=tokens)
    generated, elapsed = 0, 0.0
    for at in range(0, len(chats), batch):
        states = [
            engine.requests[engine.add_request(messages=m, params=params)] for m in chats[at : at + batch]
        ]
        while any(s.seq.num_output_tokens == 0 for s in states):
            engine.step()
        first = sum(s.seq.num_output_tokens for s in states)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        elapsed += time.perf_counter() - start
        generated += sum(s.seq.num_output_tokens for s in states) - first
    return generated / elapsed


def greedy_outputs(
    engine: Engine, chats: list[list[dict[str, str]]], tokens: int, batch: int
) -> list[list[int]]:
    """The greedy output tokens of ``chats``, run ``batch`` at a time."""
    params = SamplingParams(max_tokens=tokens)
    outputs = []
    for at in range(0, len(chats), batch):
        states = [
            engine.requests[engine.add_request(messages=m, params=params)] for m in chats[at : at + batch]
        ]
        while engine.has_unfinished():
            engine.step()
        outputs += [s.seq.output_token_ids for s in states]
    return outputs


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first output position where ``a`` and ``b`` differ (one ending before the
    other counts), or None when they are identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def rows_invariant_up_to(engine: Engine, most: int = 96) -> int:
    """The most rows a step may have for every distinct linear layer of ``engine``'s
    model to give each row the bits it gives that row alone. A GEMM kernel may block
    (and so sum) differently by row count, so a verification step (k+1 rows per
    sequence) gives plain decode's bits only while both stay within this."""
    torch.manual_seed(0)
    layers = {(m.in_features, m.out_features): m for m in engine.runner.model.modules() if _is_linear(m)}
    rows = most
    with torch.inference_mode():
        for layer in layers.values():
            x = torch.randn(most, layer.in_features).to(engine.dtype)
            alone = torch.cat([layer(x[i : i + 1]) for i in range(most)])
            rows = next((m - 1 for m in range(2, rows + 1) if not torch.equal(layer(x[:m]), alone[:m])), rows)
    return rows


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear | PackedLinear)


HEADER = ["run", "identical", "rate", "drafts kept", "first differing"]


def agreement(args: argparse.Namespace) -> int:
    """Greedy outputs with and without n-gram speculation, per dtype, packing, workload
    and batch (see the module docstring)."""
    rows, figures = [], {}
    for dtype in args.dtypes.split(","):
        # a small KV cache: 16 prompts of ~200 tokens at most at once
        base = dict(model="smollm2", dtype=dtype, max_num_seqs=16, max_model_len=2048)
        base["kv_cache_memory_mib"] = 256
        plain = Engine(EngineConfig(**base))
        ngram = SpeculativeConfig("ngram", num_tokens=args.num_tokens)
        spec = Engine(EngineConfig(**base, speculative=ngram))
        invariant = rows_invariant_up_to(plain)
        figures[f"{dtype}_linears_row_invariant_up_to"] = invariant
        print(f"{dtype}: {plain.summary}; linear layers row-invariant up to {invariant} rows", flush=True)
        for name in args.workloads.split(","):
            chats = workload(name, args.prompts)
            for batch in (int(b) for b in args.batches.split(",")):
                reference = greedy_outputs(plain, chats, args.tokens, batch)
                for packing in args.verification.split(","):
                    spec.runner.spread_drafts = packing == "rows"
                    before = spec.stats().speculation.accepted_tokens
                    outputs = greedy_outputs(spec, chats, args.tokens, batch)
                    accepted = spec.stats().speculation.accepted_tokens - before
                    diffs = [first_difference(a, b) for a, b in zip(reference, outputs, strict=True)]
                    same = diffs.count(None)
                    split = [d for d in diffs if d is not None]
                    key = f"{dtype}_{packing}_{name}_batch{batch}"
                    figures[key] = dict(identical=same, prompts=len(chats), first_differences=split)
                    rows.append([key, f"{same}/{len(chats)}", same / len(chats), accepted, split or "-"])
                    print(harness.table(HEADER, rows[-1:]), flush=True)
    print(f"n-gram speculation, at most {args.num_tokens} tokens per step, {args.tokens} tokens greedy:")
    print(harness.table(HEADER, rows))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--workloads", default="copy,chat")
    ap.add_argument("--num-tokens", type=int, default=4, help="the most tokens proposed per step")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts run one by one at batch 1")
    ap.add_argument("--methods", default="ngram,self", help="proposers measured: ngram, self")
    ap.add_argument("--draft-layers", type=int, default=8, help="self: the target's first layers drafting")
    ap.add_argument("--agreement", action="store_true", help="measure exactness instead of speed")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="agreement: the dtypes compared")
    ap.add_argument("--prompts", type=int, default=8, help="agreement: prompts of each workload")
    ap.add_argument("--verification", default="rows,chunk", help="agreement: packings (rows, chunk)")
    harness.add_json_argument(ap)
    args = ap.parse_args(argv)
    if args.agreement:
        return agreement(args)
    base = dict(model="smollm2", dtype=args.dtype, max_num_seqs=64, max_model_len=2048)
    plain = Engine(EngineConfig(**base))
    specs = {
        method: Engine(
            EngineConfig(
                **base,
                speculative=SpeculativeConfig(
                    method,
                    num_tokens=args.num_tokens,
                    draft_layers=args.draft_layers if method == "self" else 0,
                ),
            )
        )
        for method in args.methods.split(",")
    }
    print(f"SmolLM2-135M, {plain.summary}; self-speculation from the first {args.draft_layers} of 30 layers")
    rows, figures = [], {}
    for name in args.workloads.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            chats = workload(name, batch if batch > 1 else args.batch1_prompts)
            for method, spec in specs.items():
                before = spec.stats().speculation
                pair = harness.paired(
                    lambda chats=chats, batch=batch: decode_rate(plain, chats, args.tokens, batch),
                    lambda chats=chats, batch=batch, spec=spec: decode_rate(spec, chats, args.tokens, batch),
                    args.rounds,
                )
                after = spec.stats().speculation
                proposed, accepted = (
                    after.proposed_tokens - before.proposed_tokens,
                    after.accepted_tokens - before.accepted_tokens,
                )
                steps = after.verified_steps - before.verified_steps
                rate, length = accepted / max(proposed, 1), 1 + accepted / max(steps, 1)
                key = f"{name}_batch{batch}_{method}"
                figures[key] = dict(
                    plain=statistics.median(pair.baseline),
                    speculating=statistics.median(pair.candidate),
                    ratio=pair.ratio,
                    acceptance=rate,
                    mean_accepted_length=length,
                    proposed_per_step=proposed / max(steps, 1),
                )
                rows.append(
                    [key, figures[key]["plain"], figures[key]["speculating"], pair.ratio, rate, length]
                )
    print(harness.table(["workload", "plain tok/s", "spec tok/s", "ratio", "accept", "mean len"], rows))
    headline = rows[0][0]  # the first row measured (n-gram on copy-heavy at batch 1 by default)
    harness.report(
        f"{headline} decode tok/s, speculating over plain", figures[headline]["ratio"], args.json, **figures
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
