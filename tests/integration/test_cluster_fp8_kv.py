"""FP8 KV caches in both pools (``kv_cache_dtype: fp8``): a TP=1 prefill worker
streams its KV over NIXL to a TP=2 decode group, as FP8 bytes with the source's
scales, each decode rank rescaling its heads into its own. Every prompt attends
over its K/V as an FP8 cache holds them (chunked or not), and each worker's scales
are powers of two calibrated on the same prompt, so the streams equal a monolithic
FP8-KV engine's greedy tokens exactly; no KV stays held afterwards."""

from __future__ import annotations

from splitserve.client import Client
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from tests.integration.cluster_util import (
    assert_kv_moved,
    live_cluster,
    mixed_workload,
    reference_tokens,
    stream_all,
    tiny_config,
    wait_kv_free,
)


def test_fp8_kv_crosses_from_a_tp1_prefill_worker_to_a_tp2_decode_group_exactly(checkpoint):
    engine = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256, "kv_cache_dtype": "fp8"}
    config = tiny_config(
        checkpoint,
        prefill={"num_cpus": 0.5, "engine": engine},
        decode={"num_cpus": 0.5, "tp_size": 2, "engine": engine},
    )
    reference = Engine(
        EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=2048, kv_cache_dtype="fp8")
    )
    assert str(reference.kv_cache.tensor.dtype) == "torch.float8_e4m3fn"
    prompts, params = mixed_workload(16, seed=8)
    expected = reference_tokens(reference, prompts, params)
    with live_cluster(config) as cluster:
        results = stream_all(cluster.address, prompts, params)
        assert [out.token_ids for out, _ in results] == expected
        with Client(cluster.address, timeout=60) as client:
            assert_kv_moved([out.final for out, _ in results], client)
            used = wait_kv_free(client, timeout=30)
    assert set(used.values()) == {0}, used
