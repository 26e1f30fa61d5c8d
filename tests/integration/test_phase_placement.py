"""Multi-node serving on a real three-node Ray cluster on localhost
(``ray.cluster_utils.Cluster``): a head with no phase resource, a node that
advertises ``splitserve_prefill`` and one that advertises ``splitserve_decode``.
``splitserve serve --address`` attaches to it, each pool asks for its phase's
resource, and:

- each worker is placed on its phase's node (Ray's placement-group table,
  checked against the resources ``ray.nodes()`` reports for that node), and
  the status service (``splitserve status``) names that node and its type;
- 32 concurrent streams, their KV moved over NIXL between the two nodes, equal
  the monolithic engine's greedy tokens;
- a pool asking for a resource no node offers is given up after its
  ``placement_timeout_s`` with an error naming the resource, and leaves
  nothing behind (not a hang).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from splitserve.client import Client
from splitserve.cluster.app import BackgroundCluster
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from tests.integration.cluster_util import (
    mixed_workload,
    own_ray,
    reference_tokens,
    stream_all,
    tiny_config,
)
from tests.waiting import wait_until

POOL = {"num_cpus": 1, "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}}


@pytest.fixture(scope="module")
def three_nodes():
    """(cluster, prefill node, decode node); the head has one CPU and no phase. This
    process joins it too (to read Ray's node table)."""
    own_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    prefill = cluster.add_node(num_cpus=1, resources={"splitserve_prefill": 1})
    decode = cluster.add_node(num_cpus=1, resources={"splitserve_decode": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster, prefill, decode
    finally:
        ray.shutdown()
        cluster.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phase_config(checkpoint: str, address: str, **prefill_extra):
    return tiny_config(
        checkpoint,
        ray={"address": address},
        prefill={**POOL, "resources": {"splitserve_prefill": 1}, **prefill_extra},
        decode={**POOL, "resources": {"splitserve_decode": 1}},
        transfer={"backend": "nixl"},
    )


def test_served_with_address_each_pool_lands_on_its_phase_node_and_serves_32_streams(
    three_nodes, checkpoint, tmp_path
):
    """``splitserve serve --address`` (a real CLI process) onto the running cluster."""
    cluster, prefill_node, decode_node = three_nodes
    prompts, params = mixed_workload(32, seed=41)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    reference = reference_tokens(engine, prompts, params)
    config = phase_config(checkpoint, address="").model_dump(mode="json", exclude={"ray"})
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    cmd = [sys.executable, "-m", "splitserve.cli.main", "serve", "--config", str(path)]
    server = subprocess.Popen(
        [*cmd, "--address", cluster.address, "--port", str(port)], stdout=log, stderr=log
    )
    address = f"127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            return Client(address, retries=0).health(timeout=1.0)

        wait_until(up, "splitserve serve --address up", 300, 0.5)
        with Client(address) as client:  # what `splitserve status` prints
            shown = {w.worker_id: w for pool in client.cluster_status().pools for w in pool.workers}
        assert {k: (w.node_id, w.node_type, w.waiting_for_node) for k, w in shown.items()} == {
            "prefill-0": (prefill_node.node_id, "splitserve_prefill", False),
            "decode-0": (decode_node.node_id, "splitserve_decode", False),
        }
        printed = subprocess.run(
            [sys.executable, "-m", "splitserve.cli.main", "status", "--server", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert printed.returncode == 0, printed.stderr
        assert f"{prefill_node.node_id[:12]} (splitserve_prefill)" in printed.stdout
        assert f"{decode_node.node_id[:12]} (splitserve_decode)" in printed.stdout
        resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}  # Ray's view
        assert "splitserve_prefill" in resources[shown["prefill-0"].node_id]
        assert "splitserve_decode" in resources[shown["decode-0"].node_id]
        results = stream_all(address, prompts, params)
        for (out, _), ref in zip(results, reference):
            assert out.token_ids == ref
            assert out.final.prefill_worker == "prefill-0"
            # a request that ends at its first token never reaches a decode worker
            assert out.final.decode_worker == ("" if len(ref) == 1 else "decode-0")
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(120) == 0
        log.close()


def test_a_pool_no_node_can_hold_is_given_up_with_a_clear_error(three_nodes, checkpoint):
    cluster, _, _ = three_nodes
    config = phase_config(
        checkpoint, cluster.address, resources={"splitserve_prefill_h100": 1}, placement_timeout_s=2
    )
    with pytest.raises(
        RuntimeError, match="cannot place prefill-0.*splitserve_prefill_h100.*placement_timeout_s"
    ):
        BackgroundCluster(config)
    # nothing is left behind: the decode worker started meanwhile is gone with its placement group
    wait_until(
        lambda: ray.available_resources().get("splitserve_decode") == 1,
        "the decode worker's placement group removed",
        60,
        0.1,
    )
