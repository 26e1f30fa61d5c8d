"""Expert parallelism for real: two rank processes over gloo (localhost), each
holding half of every MoE layer's routed experts and running attention for its
own sequences (data-parallel), tokens exchanged by all-to-all.

- The exchange itself (``dispatch_combine``) against the whole layer computed in
  one process, with skewed routing: every token to one expert (all of them on one
  rank), every token to the other rank's experts only (a rank whose experts get
  none), and a rank with no tokens at all.
- Mixtral, Qwen3-MoE and DeepSeek-V3 (MLA, shared expert, grouped routing with a
  correction bias, dense first layer) under EP=2: greedy tokens equal
  transformers' ``generate``, with the second pass hitting each rank's prefix
  cache, and with a cache small enough to preempt; both ranks ran sequences.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import time

import pytest
import torch

from splitserve.engine.model.moe import expert_rows, grouped_experts
from splitserve.engine.parallel.expert_parallel import ExpertShard, dispatch_combine
from splitserve.engine.parallel.group import TPGroup
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from splitserve.wire.tp import TPInit
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
from tests.integration.tp_ranks import RankJob, _exit, expert_parallel_rank, free_port

CTX = mp.get_context("spawn")
E, H, INTER, K = 8, 32, 16, 2  # experts, hidden, expert width, top-k
MAX_NEW = 12
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def _experts():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * INTER, H, generator=g) * 0.3, torch.randn(E, H, INTER, generator=g) * 0.3


def _tokens(rank: int, case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, weights, ids) of ``rank``'s tokens in ``case``."""
    g = torch.Generator().manual_seed(10 + rank)
    t = {"random": 23, "one_expert": 19, "other_rank_only": 17, "one_rank_idle": 0 if rank else 29}[case]
    x = torch.randn(t, H, generator=g)
    weights = torch.rand(t, K, generator=g)
    if case == "one_expert":  # every pair on expert 5 (rank 1's), each token twice
        ids = torch.full((t, K), 5)
    elif case == "other_rank_only":  # experts 0..3 only (rank 0's): rank 1's experts get no row
        ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(t)]) if t else torch.empty(0, K)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.empty(0, K)
    return x, weights, ids.long()


def _exchange_rank(rank: int, port: int, case: str, out) -> None:
    torch.set_num_threads(1)
    group = TPGroup.join(TPInit(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=60), torch.device("cpu"))
    gate_up, down = _experts()
    shard = ExpertShard.of(E, rank, 2)
    held_gate_up, held_down = (
        gate_up[shard.first : shard.first + shard.count],
        down[shard.first :][: shard.count],
    )
    computed: list[int] = []

    def compute(rows, local_ids):
        computed.append(rows.shape[0])
        return expert_rows(rows, local_ids, held_gate_up, held_down)

    x, weights, ids = _tokens(rank, case)
    got = dispatch_combine(group, x, weights, ids, shard.count, compute)
    out.put((rank, got.numpy(), computed[0]))  # by value: a shared tensor's fd dies with its process
    group.destroy()
    _exit(out)


@pytest.mark.parametrize("case", ["random", "one_expert", "other_rank_only", "one_rank_idle"])
def test_all_to_all_dispatch_and_combine_equal_the_whole_layer(case):
    port, out = free_port(), CTX.Queue()
    procs = [CTX.Process(target=_exchange_rank, args=(r, port, case, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {
        rank: (torch.from_numpy(got), rows) for rank, got, rows in (out.get(timeout=120) for _ in procs)
    }
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    gate_up, down = _experts()
    pairs_to = [0, 0]  # rows each rank's experts should have computed
    for rank in (0, 1):
        x, weights, ids = _tokens(rank, case)
        want = grouped_experts(x, gate_up, down, weights, ids)  # every expert, one process
        torch.testing.assert_close(results[rank][0], want, rtol=1e-5, atol=1e-5)
        for owner in (0, 1):
            pairs_to[owner] += int((ids // (E // 2) == owner).sum())
    assert [results[r][1] for r in (0, 1)] == pairs_to
    if case in ("one_expert", "other_rank_only"):
        assert 0 in pairs_to  # one rank's experts really got no row


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "deepseek_v3"])
def reference(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, directory)
    prompts = random_prompts([3, 17, 47, 90], 512) + random_prompts([60, 71], 512, seed=2, shared_prefix=40)
    return directory, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _collect(out, procs, n: int, deadline_s: float = 300) -> list:
    """``n`` results from ``out``; fails as soon as a rank process died without its own."""
    results: list = []
    deadline = time.monotonic() + deadline_s
    while len(results) < n:
        try:
            results.append(out.get(timeout=1))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"rank exit codes {dead}, {len(results)} results"
    return results


def _run_ep2(directory, prompts, **engine):
    cfg = EngineConfig(
        model=str(directory),
        dtype="float32",
        ep_size=2,
        block_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        **engine,
    )
    port, out = free_port(), CTX.Queue()
    jobs = [RankJob(r, 2, port, dataclasses.replace(cfg), prompts, PARAMS) for r in (0, 1)]
    procs = [CTX.Process(target=expert_parallel_rank, args=(job, out), daemon=True) for job in jobs]
    for p in procs:
        p.start()
    results = _collect(out, procs, 3)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    tokens = next(r for r in results if r[0] == "tokens")
    ran = {r[1]: r[2:] for r in results if r[0] == "ran"}
    return tokens[1], tokens[2], tokens[3], ran


def test_ep2_greedy_equals_transformers_with_prefix_hits(reference):
    directory, prompts, expected = reference
    passes, cached, _, ran = _run_ep2(directory, prompts, num_kv_blocks=64)
    assert passes[0] == expected
    assert passes[1] == expected  # the second pass, from each rank's prefix cache
    assert all(c >= (len(p) - 1) // 8 * 8 for c, p in zip(cached, prompts))
    tokens_run, routed = zip(*(ran[r] for r in (0, 1)))
    assert all(n > 0 for n in tokens_run)  # both ranks ran attention for sequences of their own
    assert all(n > 0 for n in routed)  # both ranks' experts computed rows


def test_ep2_greedy_equals_transformers_under_preemption(reference):
    directory, prompts, expected = reference
    # 16 blocks of 8 per rank (2 x 128 tokens): less than the batch needs (~440), more than
    # any one sequence
    passes, _, preemptions, _ = _run_ep2(directory, prompts, num_kv_blocks=16, enable_prefix_caching=False)
    assert passes == [expected, expected]
    assert preemptions > 0
