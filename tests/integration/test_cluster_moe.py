"""Mixture-of-experts and MLA models through the disaggregated cluster: float32
greedy tokens equal transformers' own ``generate`` (each case its own Ray
instance and cluster, over NIXL), the second pass of the same prompts hitting the
prefix cache:

| family      | attention | MoE                                      | prefill TP | decode          |
|-------------|-----------|------------------------------------------|------------|-----------------|
| mixtral     | GQA       | 4 experts, softmax top 2                 | 2          | EP 2            |
| qwen3_moe   | GQA, norm | 8 experts, layer 0 dense                 | 1          | EP 2            |
| deepseek_v3 | MLA       | sigmoid, grouped, bias, shared, 0 dense  | 2          | TP 2            |
| gpt_oss     | GQA, sinks, sliding 16 | 4 experts with biases, clamped SwiGLU | 2   | EP 2            |
| glm4_moe    | GQA, norm, half RoPE | as deepseek_v3, 2 groups            | 1          | TP 2            |
| deepseek_v32 | MLA + indexer (top 8) | as deepseek_v3                     | 2          | EP 2            |

(DeepSeek-V3 under EP is the rank-loss test's case below, equal to transformers too;
a TP=1 decode worker is every dense cluster test's.)

With MLA every rank holds the same latent rows (one plane, one "head"); a decode
rank reads them from one source rank. Under EP (experts split over the decode
group's ranks, attention data-parallel) the one rank whose share of the cache holds
a request reads its whole KV; each EP case also checks that both ranks' experts
computed rows.
"""

from __future__ import annotations

import pytest
import ray

from splitserve.client import Chunk, Client, Completion
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
from tests.integration.cluster_util import (
    assert_kv_moved,
    kv_used,
    live_cluster,
    scrape,
    stream_all,
    tiny_config,
    total,
    wait_until,
)

ENGINE = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 64, "block_size": 8}
MAX_TOKENS = 8


CASES = [
    ("deepseek_v3", 2, {"tp_size": 2}),
    ("mixtral", 2, {"ep_size": 2}),
    ("qwen3_moe", 1, {"ep_size": 2}),
    ("gpt_oss", 2, {"ep_size": 2}),
    ("glm4_moe", 1, {"tp_size": 2}),
    ("deepseek_v32", 2, {"ep_size": 2}),
]


@pytest.mark.parametrize(
    "kind, prefill_tp, decode",
    CASES,
    ids=[f"{k}-tp{p}-{'ep' if 'ep_size' in d else 'tp'}{max(d.values())}" for k, p, d in CASES],
)
def test_moe_and_mla_through_the_cluster_equal_transformers(tmp_path, kind, prefill_tp, decode):
    model = make_hf_checkpoint(kind, tmp_path)
    prompts = random_prompts([5, 40, 120, 33], 512, seed=13)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    config = tiny_config(
        str(tmp_path),
        prefill={"num_cpus": 0.5, "tp_size": prefill_tp, "engine": ENGINE},
        decode={"num_cpus": 0.5, **decode, "engine": ENGINE},
    )
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * len(prompts)
    with live_cluster(config) as cluster, Client(cluster.address, timeout=60) as client:
        first = stream_all(cluster.address, prompts, params)
        assert_kv_moved([out.final for out, _ in first], client)  # every KV handed over
        again = stream_all(cluster.address, prompts, params)
        if "ep_size" in decode:  # both ranks' experts computed rows (the expert load metric)
            loads = lambda: total_by_rank(scrape(cluster))  # noqa: E731
            wait_until(lambda: len(loads()) == 2 and all(loads().values()), "both ranks' experts used")
    assert [out.token_ids for out, _ in first] == expected
    assert [out.token_ids for out, _ in again] == expected
    # the second pass found each prompt's full blocks in a cache
    assert all(out.final.cached_prompt_tokens >= (len(p) - 1) // 8 * 8 for (out, _), p in zip(again, prompts))


def total_by_rank(values: dict) -> dict[str, float]:
    """The decode pool's ``splitserve:expert_routed_tokens_total`` by rank."""
    found: dict[str, float] = {}
    for (name, labels), v in values.items():
        labels = dict(labels)
        if name == "splitserve:expert_routed_tokens_total" and labels["pool"] == "decode":
            found[labels["rank"]] = found.get(labels["rank"], 0.0) + v
    return found


def test_an_mla_handover_moves_one_latent_row_per_token_and_layer(tmp_path):
    """KV bytes per token, measured on a handover (the router's count of KV bytes the
    decode workers pulled) for a DeepSeek-V3-shaped model and a GQA model of the same
    hidden size, against the formulas of ``docs/models.md``, computed here from the
    transformers configs: MLA ``layers x (kv_lora_rank + qk_rope_head_dim) x 4`` bytes
    (float32; DeepSeek-V3.2 ``+ index_head_dim``, the indexer's key), GQA
    ``layers x 2 x kv_heads x head_dim x 4``."""
    measured = {}
    prompt = random_prompts([40], 512, seed=3)  # 5 whole blocks of 8
    for kind in ("deepseek_v3", "deepseek_v32", "llama"):
        directory = tmp_path / kind
        hf = make_hf_checkpoint(kind, directory).config
        if kind == "deepseek_v3":
            formula = hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4
        elif kind == "deepseek_v32":  # the indexer's key beside the latent
            formula = hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim + hf.index_head_dim) * 4
        else:
            head_dim = hf.hidden_size // hf.num_attention_heads
            formula = hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim * 4
        config = tiny_config(
            str(directory),
            prefill={"num_cpus": 0.5, "engine": ENGINE},
            decode={"num_cpus": 0.5, "engine": ENGINE},
        )
        with live_cluster(config) as cluster, Client(cluster.address, timeout=60) as client:
            before = total(scrape(cluster), "splitserve:kv_transfer_bytes_total")
            ((out, _),) = stream_all(cluster.address, prompt, [SamplingParams(max_tokens=2, ignore_eos=True)])
            assert out.final.prefill_worker == "prefill-0"
            measured[kind] = (total(scrape(cluster), "splitserve:kv_transfer_bytes_total") - before) / 40
            shown = {w.kv_bytes_per_token for p in client.cluster_status().pools for w in p.workers}
        assert measured[kind] == formula, (kind, measured[kind], formula)
        assert shown == {formula}  # what `splitserve status` prints
    assert measured["deepseek_v3"] < measured["deepseek_v32"] < measured["llama"]


def test_deepseek_v3_mtp_on_the_decode_side_only_equals_transformers(tmp_path):
    """A prefill pool that does not speculate, a decode pool proposing with DeepSeek-V3's
    MTP layer: both run the layer (its KV is one more layer of the handed-over KV, so
    both caches have it), the tokens are transformers' greedy ones, and the decode
    workers proposed. (That the layer's KV itself crosses a handoff intact is
    ``tests/unit/engine/speculative/test_mtp.py``'s, in one process.)"""
    model = make_hf_checkpoint("deepseek_v3", tmp_path, mtp=True)
    prompts = random_prompts([5, 40, 33], 512, seed=14)
    max_tokens = 16
    expected = [hf_greedy(model, p, max_tokens) for p in prompts]
    mtp = {"method": "mtp", "num_tokens": 1}
    config = tiny_config(
        str(tmp_path),
        prefill={"num_cpus": 0.5, "engine": ENGINE},
        decode={"num_cpus": 0.5, "engine": {**ENGINE, "speculative": mtp}},
    )
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(prompts)
    with live_cluster(config) as cluster, Client(cluster.address, timeout=60) as client:
        out = stream_all(cluster.address, prompts, params)
        assert_kv_moved([o.final for o, _ in out], client)
        methods = {w.role: w.speculation.method for p in client.cluster_status().pools for w in p.workers}
    assert [o.token_ids for o, _ in out] == expected
    assert methods == {"prefill": "", "decode": "mtp"}
    assert all(o.final.draft_tokens > 0 for o, _ in out), [o.final for o, _ in out]


@pytest.mark.parametrize("parallel", ["tp_size", "ep_size"])
def test_an_mla_moe_decode_group_losing_a_rank_resumes_exactly(tmp_path, parallel):
    """DeepSeek-V3 (MLA + MoE) on decode groups of 2 ranks (TP, or EP with attention
    data-parallel): killing rank 1 of the group holding a stream mid-way ends it there
    with ``WorkerLost``; the router resumes it on the other group, and the whole output
    still equals transformers' greedy."""
    hf = make_hf_checkpoint("deepseek_v3", tmp_path)
    prompt = random_prompts([60], 512, seed=11)[0]
    expected = hf_greedy(hf, prompt, 300)
    config = tiny_config(
        str(tmp_path),
        prefill={"num_cpus": 0.25, "engine": ENGINE},
        decode={"num_cpus": 0.25, parallel: 2, "replicas": 2, "engine": ENGINE},
    )
    with live_cluster(config) as cluster, Client(cluster.address, timeout=60) as client:
        pool = cluster.cluster.pools["decode"]
        out, killed = Completion(), None
        for item in client.stream(prompt, temperature=0, max_tokens=300, ignore_eos=True, timeout_ms=600_000):
            out.add(item)
            if killed is None and isinstance(item, Chunk) and len(out.token_ids) >= 20:
                (holder,) = [w for w, used in kv_used(client).items() if w.startswith("decode") and used]
                killed = holder
                ray.kill(pool.actors(holder)[1], no_restart=True)  # its rank 1
    assert killed is not None, "the stream ended before a rank could be killed"
    assert out.token_ids == expected
    assert out.final.decode_worker not in ("", killed)
