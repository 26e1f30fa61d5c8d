"""Phase placement on a real two-node Ray cluster on localhost
(``ray.cluster_utils.Cluster``): one node advertises ``splitserve_decode``, the
other ``splitserve_prefill``, and each pool asks for its phase's resource. Each
worker must land on its phase's node and the cluster must serve the
monolithic engine's greedy tokens across the two nodes. A pool asking for a
resource no node offers is given up after its ``placement_timeout_s`` with an
error naming the resource, not a hang."""

from __future__ import annotations

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from splitserve.client import Client
from splitserve.cluster.app import BackgroundCluster
from splitserve.engine import Engine, EngineConfig, SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import VOCAB, tiny_checkpoint, tiny_config

POOL = {"num_cpus": 1, "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def two_nodes():
    """A head node for decode and a second node for prefill, one CPU each."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"splitserve_decode": 1}},
    )
    prefill_node = cluster.add_node(num_cpus=1, resources={"splitserve_prefill": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster, prefill_node
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_each_pool_lands_on_its_phase_node_and_serves(two_nodes, checkpoint):
    cluster, prefill_node = two_nodes
    config = tiny_config(
        checkpoint,
        prefill={**POOL, "resources": {"splitserve_prefill": 1}},
        decode={**POOL, "resources": {"splitserve_decode": 1}},
    )
    prompts = random_prompts([12, 40, 70], VOCAB, seed=21)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    reference = [c.token_ids for c in engine.generate(prompts, params)]
    with BackgroundCluster(config) as c:
        pools = c.cluster.pools
        assert pools["prefill"].node_of("prefill-0") == prefill_node.node_id
        assert pools["decode"].node_of("decode-0") == cluster.head_node.node_id
        with Client(c.address, timeout=120) as client:
            for prompt, ref in zip(prompts, reference):
                out = client.generate(prompt, max_tokens=12, ignore_eos=True)
                assert out.token_ids == ref
                assert (out.final.prefill_worker, out.final.decode_worker) == ("prefill-0", "decode-0")


def test_a_pool_no_node_can_hold_is_given_up_with_a_clear_error(two_nodes, checkpoint):
    config = tiny_config(
        checkpoint,
        prefill={**POOL, "resources": {"splitserve_prefill_h100": 1}, "placement_timeout_s": 2},
        decode={**POOL, "resources": {"splitserve_decode": 1}},
    )
    with pytest.raises(
        RuntimeError, match="cannot place prefill-0.*splitserve_prefill_h100.*placement_timeout_s"
    ):
        BackgroundCluster(config)
    # nothing is left behind: the placement groups of the given-up start are removed
    deadline = time.monotonic() + 60
    while ray.available_resources().get("splitserve_decode") != 1:
        assert time.monotonic() < deadline, "the decode worker's placement group was not removed"
        time.sleep(0.1)
