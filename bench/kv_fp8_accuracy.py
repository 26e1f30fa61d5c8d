"""What an FP8 KV cache costs in accuracy and saves in bytes, against a bf16 one.

    python -m splitserve.bench.kv_fp8_accuracy [--model smollm2] [--prompts 50] [--max-tokens 32]

Two engines of the same model in bf16, one with ``kv_cache_dtype: fp8``, same run:

- greedy generation of ``--max-tokens`` tokens for each of ``--prompts`` chat
  prompts: the share of generated tokens equal to the bf16-KV run's at the same
  position, the prompts whose outputs are identical, and the mean identical
  prefix;
- the perplexity of a fixed English text (``TEXT``, teacher-forced, every
  position attending over the KV as each cache holds it);
- the bytes one handoff moves for a 512-token prompt (``KVSource.export``'s
  ``num_bytes``) and the scales an FP8 handshake carries once per peer.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from splitserve.bench.engine_bench import common_prefix
from splitserve.bench.quant_accuracy import prompt_logits
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams

TOPICS = (
    "volcanoes", "honeybees", "the moon", "glaciers", "octopuses", "bread", "chess", "rainbows",
    "the printing press", "penguins", "coral reefs", "thunderstorms", "the violin", "deserts",
    "photosynthesis", "the Roman Empire", "bicycles", "tea", "black holes", "the Nile",
    "owls", "earthquakes", "origami", "the piano", "mushrooms", "comets", "tigers", "cheese",
    "the Great Wall", "submarines", "maple trees", "lightning", "dolphins", "pottery", "the sun",
    "bamboo", "the Sahara", "whales", "windmills", "coffee", "the Amazon", "snowflakes",
    "elephants", "paper", "the Eiffel Tower", "tornadoes", "butterflies", "rice", "the ocean",
    "clocks",
)  # fmt: skip

TEXT = (
    "The water cycle describes how water moves between the oceans, the air and the land. "
    "Heat from the sun evaporates water from seas, lakes and rivers, and plants release "
    "water vapour through their leaves. As the warm, moist air rises it cools, and the vapour "
    "condenses into tiny droplets that gather as clouds. When the droplets grow heavy enough "
    "they fall as rain, snow or hail. Some of that water soaks into the ground and refills "
    "underground stores called aquifers, some runs off into streams that carry it back to the "
    "sea, and some is frozen for years in glaciers and ice caps. The same water has been "
    "travelling around this cycle for billions of years, which is why the rain that falls "
    "today may once have been part of an ancient ocean or a cloud above a forest long gone."
)


def perplexity(engine: Engine, ids: list[int]) -> float:
    logits = prompt_logits(engine, ids)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return nll.exp().item()


def handoff_bytes(engine: Engine, prompt: list[int]) -> int:
    """What one export of ``prompt``'s KV moves (prefilled into the engine's cache)."""
    from splitserve.kv_transfer.backends.local import LocalHub, LocalSource
    from splitserve.wire.kv import CompatInfo

    rid = engine.add_request(prompt, SamplingParams(max_tokens=2))
    engine.step()
    seq = engine.requests[rid].seq
    kv = engine.kv_cache
    source = LocalSource(
        "bench", kv.tensor, CompatInfo("bench", kv.layout, kv.scale_values()), 30.0, hub=LocalHub()
    )
    desc = source.export(rid, list(seq.block_table), len(prompt))
    engine.abort(rid)
    return desc.num_bytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    base = EngineConfig(
        model=args.model,
        dtype="bfloat16",
        kv_cache_memory_mib=256,
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
    )
    bf16 = Engine(base)
    fp8 = Engine(dataclasses.replace(base, kv_cache_dtype="fp8"))
    tok = bf16.tokenizer
    questions = [f"Tell me an interesting fact about {TOPICS[i % len(TOPICS)]}." for i in range(args.prompts)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    a = [c.token_ids for c in bf16.generate(prompts, params)]
    b = [c.token_ids for c in fp8.generate(prompts, params)]
    equal = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    prefix = sum(map(common_prefix, b, a)) / len(a)
    text = tok.encode(TEXT)
    ppl_bf16, ppl_fp8 = perplexity(bf16, text), perplexity(fp8, text)
    long = [(i * 37) % 1000 + 10 for i in range(512)]
    bytes_bf16, bytes_fp8 = handoff_bytes(bf16, long), handoff_bytes(fp8, long)
    scales = len(fp8.kv_cache.scale_values())
    print(f"{args.model}: bf16 weights; bf16 KV vs fp8 KV, same run")
    print(f"{len(prompts)} chat prompts, {args.max_tokens} greedy tokens each:")
    print(f"  tokens equal to the bf16-KV run at the same position: {equal}/{total} ({equal / total:.1%})")
    same = sum(x == y for x, y in zip(a, b))
    print(f"  identical outputs: {same}/{len(a)}; mean identical prefix {prefix:.1f}")
    print(f"perplexity of a fixed {len(text)}-token text: bf16 KV {ppl_bf16:.3f}, fp8 KV {ppl_fp8:.3f} "
          f"({ppl_fp8 / ppl_bf16 - 1:+.2%})")  # fmt: skip
    print(f"one handoff of a 512-token prompt: bf16 KV {bytes_bf16:,} bytes, fp8 KV {bytes_fp8:,} bytes "
          f"({bytes_fp8 / bytes_bf16:.3f}x); the fp8 handshake carries {scales} scales "
          f"({4 * scales:,} bytes) once per peer")  # fmt: skip


if __name__ == "__main__":
    main()
