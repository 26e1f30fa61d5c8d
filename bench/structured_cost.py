"""What structured output costs: decode tokens/s of the real SmolLM2 with and without
a JSON schema, at batch 1 and 32, in the same run (the machine's speed cancels).

    python -m splitserve.bench.structured_cost [--tokens 64] [--rounds 3]

Each row runs the same chat prompts greedily, each request to ``--tokens`` output
tokens; the constrained run's schema (an object holding a long array of short
records) keeps every request going that long, so both runs generate the same
number of tokens. Tokens/s counts output tokens over the wall time of the whole
batch; each round runs both, one after the other, and the row shows the round
with the median ratio. The goal (issue 35): constrained >= 0.90x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from splitserve.bench import harness
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                "required": ["id", "ok"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def run(engine: Engine, batch: int, tokens: int, structured: bool) -> tuple[float, int]:
    """(output tokens/s, output tokens) of one batch run to the end."""
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA)) if structured else None
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, structured=spec)
    messages = [{"role": "user", "content": f"List {batch + i} records as JSON."} for i in range(batch)]
    ids = [engine.add_request(messages=[m], params=params) for m in messages]
    states = [engine.requests[i] for i in ids]
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    n = sum(len(s.seq.output_token_ids) for s in states)
    return n / elapsed, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(model="smollm2", max_num_seqs=64))
    run(engine, 2, 8, True)  # warm-up: kernels, the grammar compiler
    print(f"SmolLM2-135M, {engine.summary}")
    header = f"{'batch':>5} {'free tok/s':>11} {'schema tok/s':>13} {'ratio':>6}"
    print(f"{header}  (median of {args.rounds} paired rounds)")
    for batch in (int(b) for b in args.batches.split(",")):

        def constrained(batch=batch) -> float:
            rate, n = run(engine, batch, args.tokens, True)
            assert n == batch * args.tokens, (n, batch * args.tokens)
            return rate

        pair = harness.paired(
            lambda batch=batch: run(engine, batch, args.tokens, False)[0], constrained, args.rounds, 0
        )
        free, rate = statistics.median(pair.baseline), statistics.median(pair.candidate)
        print(f"{batch:>5} {free:>11.1f} {rate:>13.1f} {pair.ratio:>5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
