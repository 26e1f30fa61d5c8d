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
"""

from __future__ import annotations

import argparse
import statistics
import time

from splitserve.bench import harness
from splitserve.engine.engine import Engine
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
    harness.add_json_argument(ap)
    args = ap.parse_args(argv)
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
