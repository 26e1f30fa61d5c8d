"""Tensor parallelism for real: two rank processes over gloo (localhost).

- TP=2 generates the same greedy tokens as TP=1 on the same weights, for every
  model family the engine runs (biases, q/k norms, tied embeddings included).
- KV built under TP=P (each rank holding its KV heads, exported through NIXL
  from its own process) decodes under TP=D, each decode rank pulling its heads
  (merged, split, or rank to rank; replicated heads included): the tokens
  equal the TP=1 monolithic engine's.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp

import pytest
import torch

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.kv_layout import kv_head_range
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, random_prompts, tiny_hf_config
from tests.integration.tp_ranks import (
    RankJob,
    capacity_rank,
    decode_import_rank,
    free_port,
    generate_rank,
    logits_rank,
    prefill_export_rank,
)

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
CTX = mp.get_context("spawn")


def config(directory, tp_size: int) -> EngineConfig:
    return EngineConfig(
        model=str(directory), dtype="float32", tp_size=tp_size, num_kv_blocks=128, max_num_batched_tokens=64
    )


def start_ranks(target, jobs, *extra):
    procs = [CTX.Process(target=target, args=(job, *extra), daemon=True) for job in jobs]
    for p in procs:
        p.start()
    return procs


def jobs_for(directory, prompts, size=2, **engine):
    port = free_port()
    cfg = dataclasses.replace(config(directory, size), **engine)
    return [RankJob(r, size, port, cfg, prompts, PARAMS) for r in range(size)]


@pytest.mark.parametrize(
    "kind, kv_heads",
    [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("llama3", 2), ("mistral", 2), ("llama", 1)]
    + [("mixtral", 2), ("qwen2_moe", 2), ("deepseek_v3", 4)],  # experts' width split; MLA heads split
)
def test_tp2_greedy_equals_tp1(tmp_path, kind, kv_heads):
    """kv_heads 1: fewer KV heads than ranks, so both ranks hold (replicate) the one head."""
    make_hf_checkpoint(kind, tmp_path, kv_heads=kv_heads)
    prompts = random_prompts([5, 40, 77, 130], 512)
    expected = [c.token_ids for c in Engine(config(tmp_path, 1)).generate(prompts, PARAMS)]
    out = CTX.Queue()
    procs = start_ranks(generate_rank, jobs_for(tmp_path, prompts), out)
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results["tokens"] == expected
    assert results["steps"] > 0  # the follower ran the driver's steps (prefill chunks + decodes)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantization_composes_with_tp(tmp_path, method):
    """Quantized linears inside the sharded layers: TP=2 stays as close to the float
    TP=1 model as TP=1 quantized does (row-parallel shards get their own scales)."""
    from splitserve.bench.quant_accuracy import prompt_logits

    make_hf_checkpoint("llama", tmp_path)
    prompts = random_prompts([5, 40, 77, 130], 512, seed=3)
    reference = Engine(config(tmp_path, 1))
    quantized = Engine(dataclasses.replace(config(tmp_path, 1), quantization=method))
    out = CTX.Queue()
    procs = start_ranks(logits_rank, jobs_for(tmp_path, prompts, quantization=method), out)
    tp_logits = out.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for p, got in zip(prompts, map(torch.from_numpy, tp_logits)):
        ref, tp1 = prompt_logits(reference, p), prompt_logits(quantized, p)
        cos_tp2 = torch.nn.functional.cosine_similarity(got, ref, dim=-1).mean()
        cos_tp1 = torch.nn.functional.cosine_similarity(tp1, ref, dim=-1).mean()
        assert cos_tp2 >= cos_tp1 - 0.01, (cos_tp2, cos_tp1)
        assert cos_tp2 < 1 - 1e-6  # the quantized layers ran


@pytest.mark.parametrize(
    "kind, kv_heads, src_tp, dst_tp",
    [
        ("llama", 1, 2, 1),  # the one head read from rank 0; rank 1's copy exported to no reader
        ("llama3", 2, 1, 2),  # heads split: each decode rank reads half of the one export
        ("mistral", 2, 2, 2),  # rank to rank
    ],  # the cluster runs more (tests/integration/test_cluster_tp_matrix.py)
)
def test_kv_crosses_tp_sizes_and_decodes_exactly(tmp_path, kind, kv_heads, src_tp, dst_tp):
    """KV prefilled by a group of ``src_tp`` ranks (exported through NIXL from each
    rank's process) decodes under a group of ``dst_tp`` ranks, each pulling its heads
    with a ``RankSink``: the tokens equal the TP=1 monolithic engine's."""
    make_hf_checkpoint(kind, tmp_path, kv_heads=kv_heads)
    prompts = random_prompts([7, 33, 90, 150], 512, seed=4)
    expected = [c.token_ids for c in Engine(config(tmp_path, 1)).generate(prompts, PARAMS)]

    out, done = CTX.Queue(), CTX.Event()
    procs = start_ranks(prefill_export_rank, jobs_for(tmp_path, prompts, src_tp), "nixl", out, done, dst_tp)
    try:
        shards = sorted((out.get(timeout=120) for _ in procs), key=lambda s: s.rank)
        heads = [s.handshake.compat.layout.kv_head_range for s in shards]
        assert heads == [kv_head_range(kv_heads, src_tp, r) for r in range(src_tp)]
        decoders = start_ranks(decode_import_rank, jobs_for(tmp_path, [], dst_tp), shards, "nixl", out)
        tokens = out.get(timeout=120)
        for p in decoders:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        done.set()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert tokens == expected


def test_a_tp_group_takes_the_smallest_kv_cache_any_rank_can_hold(tmp_path):
    """Ranks with different budgets (as GPUs with different free memory have) agree on
    one block count, the smallest: the driver's block ids must exist on every rank."""
    make_hf_checkpoint("llama", tmp_path)
    port = free_port()
    budgets = {0: 8, 1: 2}  # MiB
    jobs = [
        RankJob(
            r,
            2,
            port,
            dataclasses.replace(config(tmp_path, 2), num_kv_blocks=None, kv_cache_memory_mib=budgets[r]),
            [],
            PARAMS,
        )
        for r in range(2)
    ]
    out = CTX.Queue()
    procs = start_ranks(capacity_rank, jobs, out)
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    cfg = tiny_hf_config("llama")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * (cfg.num_key_value_heads // 2) * head_dim * 4  # float32
    bs = jobs[0].config.block_size
    can_hold = {r: budgets[r] * 2**20 // (per_token * bs) * bs for r in budgets}
    assert got[0].num_tokens == got[1].num_tokens == min(can_hold.values()) < can_hold[0]
    assert got[0].bytes_per_token == per_token
