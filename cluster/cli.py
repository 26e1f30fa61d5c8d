"""The ``splitserve`` command line.

stdout carries only generated text, so scripts can capture it; logs and
progress go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from splitserve.engine import Engine, EngineConfig, SamplingParams, SplitserveError

    print("splitserve: no server given; running the engine in-process", file=sys.stderr)
    start = time.perf_counter()
    try:
        engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        if args.raw:
            engine.add_request(args.prompt, params)
        else:
            engine.add_request(messages=[{"role": "user", "content": args.prompt}], params=params)
    except SplitserveError as e:
        print(f"splitserve: {e}", file=sys.stderr)
        return 2
    print(f"splitserve: model loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", help="the user's message (or raw text with --raw)")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--model", default="smollm2", help="smollm2 (default), a .gguf file or an HF directory")
    gen.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
