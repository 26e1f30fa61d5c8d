"""Prefill workers copying a prompt's prefix from each other (issue 37), without Ray:
two ``PrefillWorker``s in this process, NIXL between them. The borrower takes the
blocks the holder computed instead of computing them (the copied KV equals the
holder's bit for bit), and its first token equals transformers' ``generate``;
when the holder is gone after lending, or has evicted the prefix, the borrower
computes it and the request still succeeds."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from splitserve.bench.prefix_pull import InProcessPeer
from splitserve.engine.sequence import Sequence
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.wire.config import EngineConfig
from splitserve.wire.kv import KVHandoff
from splitserve.wire.prefill import PrefillTask, PrefillWorkerSpec, PrefixLoan, PrefixPull
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

BLOCK = 8
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@dataclasses.dataclass
class InProcess(InProcessPeer):
    """The holder as its peers call it; with ``die_after_lending`` it shuts down right
    after it lends (the pull then meets a holder that is gone)."""

    die_after_lending: bool = False

    async def lend_prefix(self, loan: PrefixLoan) -> KVHandoff | None:
        lent = await self.worker.lend_prefix(loan)
        if self.die_after_lending:
            self.worker.shutdown()
        return lent


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pull-llama")
    return str(directory), make_hf_checkpoint("llama", directory)


def spec(worker_id: str, directory: str) -> PrefillWorkerSpec:
    engine = EngineConfig(model=directory, dtype="float32", block_size=BLOCK, num_kv_blocks=96)
    return PrefillWorkerSpec(worker_id, engine, "nixl", 30.0, torch_threads=1, transfer_timeout_s=2.0)


async def prefill(worker: PrefillWorker, rid: str, prompt: list[int], pull: PrefixPull | None = None):
    """Prefill on ``worker`` (its export released at once: no decode worker takes it)."""
    result = await worker.prefill(PrefillTask(rid, prompt, PARAMS, timeout_s=60, prefix_from=pull))
    await worker.abort(rid)
    return result


def cached_kv(worker: PrefillWorker, tokens: list[int]) -> torch.Tensor:
    """The KV the worker's prefix cache holds for ``tokens`` (every one of its full blocks),
    read on its engine's thread."""

    def read(engine):
        probe = Sequence("probe", list(tokens), SamplingParams())
        blocks = engine.block_manager.find_cached_prefix(probe, whole=True)
        assert len(blocks) == len(tokens) // BLOCK, "the prefix is not cached whole"
        return engine.kv_cache.read_blocks(blocks).clone()

    return worker.loop.call(read).result(timeout=60)


async def wait_free(worker: PrefillWorker) -> None:
    """Until the worker holds no KV block (its exports' and loans' leases all ended)."""
    async with asyncio.timeout(60):  # the condition is a call on the worker's loop: polled here
        while (stats := await worker.stats()).engine.num_free_blocks != stats.engine.num_blocks:
            await asyncio.sleep(0.01)


def test_a_prefill_worker_copies_a_prefix_another_computed_and_computes_it_when_that_fails(model):
    directory, hf = model
    prefix = random_prompts([96], 512, seed=31)[0]  # 12 blocks
    first, second, third, fourth = (prefix + t for t in random_prompts([9, 13, 5, 11], 512, seed=32))
    want = {tuple(p): hf_greedy(hf, p, 1) for p in (first, second, third, fourth)}
    holder, borrower = PrefillWorker(spec("h", directory)), PrefillWorker(spec("b", directory))

    async def run() -> None:
        peer = InProcess(holder)
        pull = PrefixPull(peer, "h", len(prefix) // BLOCK)
        assert (await prefill(holder, "r1", first)).output_token_ids == want[tuple(first)]

        # The borrower holds the first 3 blocks itself and copies the other 9 from h.
        await prefill(borrower, "r0", prefix[:24] + [1])
        copied = await prefill(borrower, "r2", second, pull)
        assert copied.output_token_ids == want[tuple(second)]
        assert (copied.pulled_tokens, copied.pulled_from, copied.num_cached_tokens) == (72, "h", 96)
        s = await borrower.stats()
        assert (s.prefix_pulls, s.prefix_pull_failures, s.engine.prefix_pulled_tokens) == (1, 0, 72)
        assert (await holder.stats()).engine.prefix_lent_tokens == 72
        # one token says little: the 9 blocks the borrower copied are the holder's, bit for bit
        # (its own first 3, computed in another batch shape, equal them to float32 rounding)
        mine, theirs = cached_kv(borrower, prefix), cached_kv(holder, prefix)
        assert torch.equal(mine[:, :, 3:], theirs[:, :, 3:])
        assert torch.allclose(mine[:, :, :3], theirs[:, :, :3], atol=1e-5)
        await wait_free(holder)  # the loan's lease ended with the borrower's confirmation

        # A holder that lends nothing (it has no such prefix): computed, counted as failed.
        other = random_prompts([40], 512, seed=33)[0]
        result = await prefill(borrower, "r3", other, PrefixPull(peer, "h", 4))
        assert (result.pulled_tokens, result.num_cached_tokens) == (0, 0)
        assert (await borrower.stats()).prefix_pull_failures == 1

        # A holder gone right after it lent: the pull fails, the prompt is computed.
        fresh = PrefillWorker(spec("b2", directory))
        try:
            gone = PrefixPull(InProcess(holder, die_after_lending=True), "h", len(prefix) // BLOCK)
            result = await prefill(fresh, "r4", third, gone)
            assert result.output_token_ids == want[tuple(third)]
            assert (result.pulled_tokens, result.num_cached_tokens) == (0, 0)
            assert ((await fresh.stats()).prefix_pulls, (await fresh.stats()).prefix_pull_failures) == (0, 1)
            await wait_free(fresh)
            # and it serves on, computing what it now holds itself
            result = await prefill(fresh, "r5", fourth)
            assert result.output_token_ids == want[tuple(fourth)] and result.num_cached_tokens == 96
        finally:
            fresh.shutdown()
        await wait_free(borrower)

    try:
        asyncio.run(run())
    finally:
        borrower.shutdown()
