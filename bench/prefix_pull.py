"""What a prefix copied from another prefill worker saves: time to first token of a
prompt whose prefix the prefill worker computes, against one whose prefix it copies
from a worker that computed it (``PrefillTask.prefix_from``, ``prefill_worker.borrow``).

Two prefill workers in this process (one torch thread; NIXL between them, as in a
cluster on one host), SmolLM2-135M unless ``--model`` says otherwise. For each prefix
length: the holder prefills prefix + 64 tokens; then the borrower prefills another
prefix + 64 tokens computing everything, and the holder's prefix + 64 other tokens
copying the prefix. Each measured ``--repeats`` times on fresh prefixes (median), the
ratio copy ÷ compute printed from the same run::

    python -m splitserve.bench.prefix_pull [--lengths 512 1024 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import torch

from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.wire.config import EngineConfig
from splitserve.wire.kv import Confirmation, KVHandoff
from splitserve.wire.prefill import PrefillTask, PrefillWorkerSpec, PrefixLoan, PrefixPull
from splitserve.wire.sampling import SamplingParams

SUFFIX = 64
PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)


@dataclasses.dataclass
class InProcessPeer:
    """A prefill worker in this process as its peers call it (``PrefillPeer``): what a
    ``RayPrefillWorker`` is across processes, for a borrower in the same process."""

    worker: PrefillWorker

    async def info(self):
        return await self.worker.info()

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        return await self.worker.lend_prefix(loan)

    async def confirm(self, confirmations: tuple[Confirmation, ...]) -> None:
        await self.worker.confirm(confirmations)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)


async def _prefill(worker: PrefillWorker, rid: str, prompt: list[int], pull: PrefixPull | None = None):
    """(seconds to the first token, the result); the export is released at once."""
    t0 = time.perf_counter()
    result = await worker.prefill(PrefillTask(rid, prompt, PARAMS, prefix_from=pull))
    took = time.perf_counter() - t0
    await worker.abort(rid)
    return took, result


async def _measure(holder, borrower, lengths, repeats, vocab) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    peer = InProcessPeer(holder)
    rows = []
    for n in lengths:
        compute, copy, pulled = [], [], []
        for r in range(repeats):
            sizes = (n, n, SUFFIX, SUFFIX, SUFFIX)
            own, lent, a, b, c = (torch.randint(0, vocab, (k,), generator=g).tolist() for k in sizes)
            await _prefill(holder, f"h{n}-{r}", lent + a)
            took, _ = await _prefill(borrower, f"c{n}-{r}", own + b)
            compute.append(took)
            pull = PrefixPull(peer, holder.worker_id, n // borrower.spec.engine.block_size)
            took, result = await _prefill(borrower, f"p{n}-{r}", lent + c, pull)
            copy.append(took)
            pulled.append(result.pulled_tokens)
        rows.append(
            {
                "prefix_tokens": n,
                "compute_ms": statistics.median(compute) * 1000,
                "copy_ms": statistics.median(copy) * 1000,
                "pulled_tokens": min(pulled),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    engine = EngineConfig(model=args.model, kv_cache_memory_mib=512)
    specs = [PrefillWorkerSpec(w, engine, "nixl", 60.0, torch_threads=1) for w in ("holder", "borrower")]
    holder, borrower = (PrefillWorker(s) for s in specs)
    try:
        vocab = holder.engine.model_config.vocab_size
        rows = asyncio.run(_measure(holder, borrower, args.lengths, args.repeats, vocab))
    finally:
        holder.shutdown()
        borrower.shutdown()
    print(f"\n{args.model}, {SUFFIX}-token suffix, median of {args.repeats}; time to the first token:")
    print(f"{'prefix':>7} {'computed':>10} {'copied':>10} {'copied ÷ computed':>18} {'tokens copied':>14}")
    for row in rows:
        ratio = row["copy_ms"] / row["compute_ms"]
        print(
            f"{row['prefix_tokens']:>7} {row['compute_ms']:>8.0f}ms {row['copy_ms']:>8.0f}ms "
            f"{ratio:>18.2f} {row['pulled_tokens']:>14}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
