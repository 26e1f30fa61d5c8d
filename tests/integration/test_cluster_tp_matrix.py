"""Through the cluster, float32 greedy tokens equal transformers' own ``generate``
for each model family the engine runs, with TP groups of either size on either
side of the handoff (each case its own Ray instance and cluster, over NIXL):

| family  | embeddings | KV heads | prefill TP | decode TP | what the handoff does            |
|---------|------------|----------|------------|-----------|----------------------------------|
| llama3  | tied       | 2        | 1          | 1         | rank to rank                     |
| mistral | untied     | 2        | 2          | 1         | merges two ranks' heads          |
| qwen2   | tied, bias | 1        | 1          | 2         | both decode ranks read one head  |
| qwen3   | tied, norm | 1        | 2          | 2         | rank to rank, head replicated    |
| gemma3  | tied, scaled | 2      | 2          | 1         | merges heads; sliding layers too |
| qwen3_next | untied, hybrid | 2   | 2          | 2         | KV and each rank's share of the states |
| qwen3_next | untied, hybrid | 2   | 2          | 1         | merges heads; rebuilds the states |
| qwen3_5 | untied, hybrid | 2      | 1          | 2         | splits heads and states |
"""

from __future__ import annotations

import pytest

from splitserve.client import Client
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
from tests.integration.cluster_util import (
    assert_kv_moved,
    live_cluster,
    stream_all,
    tiny_config,
)

ENGINE = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}
MAX_TOKENS = 8


@pytest.mark.parametrize(
    "kind, kv_heads, prefill_tp, decode_tp",
    [
        ("llama3", 2, 1, 1),
        ("mistral", 2, 2, 1),
        ("qwen2", 1, 1, 2),
        ("qwen3", 1, 2, 2),
        ("gemma3_text", 2, 2, 1),
        ("gemma2", 2, 1, 2),
        ("qwen3_next", 2, 2, 2),
        ("qwen3_next", 2, 2, 1),
        ("qwen3_5_text", 2, 1, 2),
    ],
)
def test_cluster_greedy_equals_transformers(tmp_path, kind, kv_heads, prefill_tp, decode_tp):
    model = make_hf_checkpoint(kind, tmp_path, kv_heads=kv_heads)
    prompts = random_prompts([5, 40, 120, 260], 512, seed=13)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    config = tiny_config(
        str(tmp_path),
        prefill={"num_cpus": 0.5, "tp_size": prefill_tp, "engine": ENGINE},
        decode={"num_cpus": 0.5, "tp_size": decode_tp, "engine": ENGINE},
    )
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * len(prompts)
    with live_cluster(config) as cluster, Client(cluster.address, timeout=60) as client:
        results = stream_all(cluster.address, prompts, params)
        assert_kv_moved([out.final for out, _ in results], client)  # every KV handed over
    assert [out.token_ids for out, _ in results] == expected
