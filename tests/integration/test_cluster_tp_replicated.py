"""TP groups over a model with one KV head: every rank holds (replicates) that head.

- A TP=2 prefill group feeding a TP=1 decode worker: the decode worker reads the
  head from rank 0 only; rank 1 exports its copy to no reader, so its lease ends
  at once.
- A TP=1 prefill worker streaming its KV layer by layer to a TP=2 decode group:
  both decode ranks read the one export (its lease ends with the second reader).

Streams equal the TP=1 engine's greedy tokens, and every block is free afterwards."""

from __future__ import annotations

import pytest

from splitserve.client import Client
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from tests.conftest import make_hf_checkpoint
from tests.integration.cluster_util import (
    assert_kv_moved,
    live_cluster,
    mixed_workload,
    reference_tokens,
    stream_all,
    tiny_config,
    wait_kv_free,
)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tiny-llama-1kv")
    make_hf_checkpoint("llama", directory, kv_heads=1)
    return str(directory)


def test_a_tp2_prefill_group_replicating_its_kv_head_serves_tp1_decode_exactly(one_kv_head):
    engine = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}
    config = tiny_config(one_kv_head, prefill={"num_cpus": 0.5, "tp_size": 2, "engine": engine})
    reference = Engine(EngineConfig(model=one_kv_head, dtype="float32", num_kv_blocks=2048))
    prompts, params = mixed_workload(12, seed=5)
    expected = reference_tokens(reference, prompts, params)
    with live_cluster(config) as cluster:
        results = stream_all(cluster.address, prompts, params)
        assert [out.token_ids for out, _ in results] == expected
        with Client(cluster.address, timeout=60) as client:
            assert_kv_moved([out.final for out, _ in results], client)
            used = wait_kv_free(client)
    assert set(used.values()) == {0}, used  # both ranks' leases ended; nothing held


def test_a_tp2_decode_group_replicating_its_kv_head_reads_one_streamed_export_twice(one_kv_head):
    engine = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}
    config = tiny_config(
        one_kv_head,
        prefill={"num_cpus": 0.5, "engine": engine},
        decode={"num_cpus": 0.5, "tp_size": 2, "engine": engine},
    )
    assert config.transfer.backend == "nixl" and config.transfer.stream_layers
    reference = Engine(EngineConfig(model=one_kv_head, dtype="float32", num_kv_blocks=2048))
    prompts, params = mixed_workload(12, seed=6)
    expected = reference_tokens(reference, prompts, params)
    with live_cluster(config) as cluster:
        results = stream_all(cluster.address, prompts, params)
        assert [out.token_ids for out, _ in results] == expected
        with Client(cluster.address, timeout=60) as client:
            assert_kv_moved([out.final for out, _ in results], client)
            used = wait_kv_free(client, timeout=30)
    assert set(used.values()) == {0}, used  # both readers confirmed every export
