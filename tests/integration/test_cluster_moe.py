"""Mixture-of-experts and MLA models through the disaggregated cluster: float32
greedy tokens equal transformers' own ``generate`` (each case its own Ray
instance and cluster, over NIXL), the second pass of the same prompts hitting the
prefix cache:

| family      | attention | MoE                                      | prefill TP | decode TP |
|-------------|-----------|------------------------------------------|------------|-----------|
| mixtral     | GQA       | 4 experts, softmax top 2                 | 2          | 1         |
| qwen3_moe   | GQA, norm | 8 experts, layer 0 dense                 | 1          | 2         |
| deepseek_v3 | MLA       | sigmoid, grouped, bias, shared, 0 dense  | 2          | 2         |

With MLA every rank holds the same latent rows (one plane, one "head"); a decode
rank reads them from one source rank.
"""

from __future__ import annotations

import pytest

from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
from tests.integration.cluster_util import live_cluster, stream_all, tiny_config

ENGINE = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 64, "block_size": 8}
MAX_TOKENS = 8


@pytest.mark.parametrize(
    "kind, prefill_tp, decode_tp",
    [("mixtral", 2, 1), ("qwen3_moe", 1, 2), ("deepseek_v3", 2, 2)],
)
def test_moe_and_mla_through_the_cluster_equal_transformers(tmp_path, kind, prefill_tp, decode_tp):
    model = make_hf_checkpoint(kind, tmp_path)
    prompts = random_prompts([5, 40, 120], 512, seed=13)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    config = tiny_config(
        str(tmp_path),
        prefill={"num_cpus": 0.5, "tp_size": prefill_tp, "engine": ENGINE},
        decode={"num_cpus": 0.5, "tp_size": decode_tp, "engine": ENGINE},
    )
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * len(prompts)
    with live_cluster(config) as cluster:
        first = stream_all(cluster.address, prompts, params)
        again = stream_all(cluster.address, prompts, params)
    assert [out.token_ids for out, _ in first] == expected
    assert [out.token_ids for out, _ in again] == expected
    assert all(out.final.prefill_worker == "prefill-0" for out, _ in first)  # every KV handed over
    # the second pass found each prompt's full blocks in a cache
    assert all(out.final.cached_prompt_tokens >= (len(p) - 1) // 8 * 8 for (out, _), p in zip(again, prompts))
