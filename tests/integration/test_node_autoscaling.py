"""Nodes that come and go with each pool, through Ray's own autoscaler (its fake
multi-node provider on localhost: real raylets launched and terminated by the
real autoscaler). The head has no phase resource; node types advertise
``splitserve_prefill`` or ``splitserve_decode`` and start with none running.

- Starting the cluster makes the autoscaler launch one node of each phase (the
  workers' placement groups wait for them), and requests are served with the
  monolithic engine's greedy tokens.
- Growing the prefill pool launches a second prefill node; the new worker
  lands there and takes requests once loaded.
- Shrinking it drains the worker, removes its placement group, and the
  autoscaler terminates the idle node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from splitserve.client import Client
from splitserve.cluster.app import BackgroundCluster
from splitserve.engine import Engine, EngineConfig, SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import VOCAB, tiny_checkpoint, tiny_config

POOL = {"num_cpus": 1, "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}}
NODE = {"node_config": {}, "min_workers": 0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory)


def fake_cluster_config() -> dict:
    """Ray's fake multi-node cluster config, with a phase per worker node type. The
    installed wheel lacks the provider's defaults file (``fake_multi_node/example.yaml``),
    so the provider is named as an ``external`` one and every field is given here."""
    store = {"object_store_memory": 150 * 2**20}
    return {
        "cluster_name": "splitserve-fake",
        "max_workers": 3,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.05,  # 3 s: an idle node goes soon after its worker
        "provider": {
            "type": "external",
            "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {},
        "docker": {},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "prefill_node": {
                **NODE,
                "resources": {"CPU": 1, "splitserve_prefill": 1, **store},
                "max_workers": 2,
            },
            "decode_node": {
                **NODE,
                "resources": {"CPU": 1, "splitserve_decode": 1, **store},
                "max_workers": 1,
            },
        },
        "head_node_type": "ray.head.default",
        **{k: [] for k in ("initialization_commands", "setup_commands", "head_setup_commands")},
        **{k: [] for k in ("worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")},
        **{k: [] for k in ("cluster_synced_files", "rsync_exclude", "rsync_filter")},
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
    }


@pytest.fixture(scope="module")
def autoscaling_ray(tmp_path_factory):
    """A head node (1 CPU, no phase) started with Ray's autoscaler on the fake provider,
    as ``ray.cluster_utils.AutoscalingCluster`` does; ``ray stop --force`` at the end,
    which also stops the nodes the autoscaler launched."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    config = tmp_path_factory.mktemp("fake") / "autoscaling.json"
    config.write_text(json.dumps(fake_cluster_config()))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    subprocess.run([ray_cli, "stop", "--force"], check=True, capture_output=True)
    subprocess.run(
        [
            ray_cli,
            "start",
            "--head",
            f"--autoscaling-config={config}",
            "--num-cpus=1",
            f"--object-store-memory={150 * 2**20}",
            "--include-dashboard=false",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    ray.init("auto", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        subprocess.run([ray_cli, "stop", "--force"], check=True, capture_output=True)


def phase_nodes(resource: str) -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)]


def wait_for(condition, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_pools_bring_their_nodes_and_give_them_back(autoscaling_ray, checkpoint):
    assert phase_nodes("splitserve_prefill") == [] and phase_nodes("splitserve_decode") == []
    config = tiny_config(
        checkpoint,
        prefill={**POOL, "resources": {"splitserve_prefill": 1}, "placement_timeout_s": 300},
        decode={**POOL, "resources": {"splitserve_decode": 1}, "placement_timeout_s": 300},
    )
    prompts = random_prompts([10, 33, 57, 80], VOCAB, seed=31)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    reference = [c.token_ids for c in engine.generate(prompts, params)]

    def served_by(client, prompt, ref) -> str:
        out = client.generate(prompt, max_tokens=10, ignore_eos=True)
        assert out.token_ids == ref
        return out.final.prefill_worker

    with BackgroundCluster(config) as c:
        prefill = c.cluster.pools["prefill"]
        assert len(phase_nodes("splitserve_prefill")) == 1 and len(phase_nodes("splitserve_decode")) == 1
        with Client(c.address, timeout=120) as client:
            assert served_by(client, prompts[0], reference[0]) == "prefill-0"

            c.run(prefill.add(1), 300)  # more than the nodes hold: Ray launches a prefill node
            nodes = phase_nodes("splitserve_prefill")
            assert len(nodes) == 2
            assert prefill.node_of("prefill-1") != prefill.node_of("prefill-0")
            assert {"prefill-0", "prefill-1"} <= {w.worker_id for w in c.registry.routable("prefill")}
            seen = {served_by(client, p, r) for p, r in zip(prompts, reference)}
            assert seen <= {"prefill-0", "prefill-1"}

            c.run(prefill.remove("prefill-1", drain_timeout_s=60), 120)
            wait_for(lambda: len(phase_nodes("splitserve_prefill")) == 1, "the idle prefill node to go")
            assert phase_nodes("splitserve_prefill") == [prefill.node_of("prefill-0")]
            assert served_by(client, prompts[1], reference[1]) == "prefill-0"
