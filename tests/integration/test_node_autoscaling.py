"""Nodes that come and go with each pool, through Ray's own autoscaler (its fake
multi-node provider on localhost: real raylets launched and terminated by the
real autoscaler). The head has no phase resource; node types advertise
``splitserve_prefill`` or ``splitserve_decode`` and start with none running.

- Starting the cluster makes Ray's autoscaler launch one node of each phase
  (the workers' placement groups wait for them).
- A step of load (12 client threads) makes splitserve's prefill policy grow
  the pool; Ray launches a second prefill node, the new worker is placed on it
  and takes requests.
  Meanwhile the status service shows the new worker waiting for a node.
- The load stops; the pool drains and shrinks, and Ray terminates the idle
  node after its idle timeout.
- No request fails or is dropped during the whole run, and every output
  equals the monolithic engine's. The test prints the timeline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from splitserve.client import Client
from splitserve.cluster.app import BackgroundCluster
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import VOCAB, own_ray, tiny_config, wait_until

MAX_TOKENS = 6
POOL = {"num_cpus": 1, "engine": {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}}
NODE = {"node_config": {}, "min_workers": 0}


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
    own_ray()  # `ray stop --force` would take the shared one down anyway
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


class Load:
    """Client threads that send the prompts over and over until stopped, checking
    every output against its reference; counts per prefill worker and failures."""

    def __init__(self, address: str, prompts, references, concurrency: int):
        self.address, self.prompts, self.references = address, prompts, references
        self.stop = threading.Event()
        self.served: dict[str, int] = {}
        self.failures: list[str] = []
        self.sent = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(concurrency)]
        for t in self._threads:
            t.start()

    def _run(self, offset: int) -> None:
        i = offset
        with Client(self.address, timeout=120) as client:
            while not self.stop.is_set():
                k = i % len(self.prompts)
                i += 1
                try:
                    out = client.generate(
                        self.prompts[k], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True
                    )
                except Exception as e:  # counted, and the test fails on it
                    with self._lock:
                        self.failures.append(f"{type(e).__name__}: {e}")
                    continue
                with self._lock:
                    self.sent += 1
                    if out.token_ids != self.references[k]:
                        self.failures.append(f"prompt {k}: {out.token_ids} != {self.references[k]}")
                    worker = out.final.prefill_worker
                    self.served[worker] = self.served.get(worker, 0) + 1

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(180)


def test_a_step_of_load_brings_a_prefill_node_and_its_end_gives_it_back(autoscaling_ray, checkpoint):
    assert phase_nodes("splitserve_prefill") == [] and phase_nodes("splitserve_decode") == []
    scaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target": 64,  # prompt tokens in flight per prefill worker
        "interval_s": 0.25,
        "upscale_delay_s": 0,
        "downscale_delay_s": 2,
        "drain_timeout_s": 60,
    }
    config = tiny_config(
        checkpoint,
        prefill={
            **POOL,
            "resources": {"splitserve_prefill": 1},
            "placement_timeout_s": 300,
            "autoscaling": scaling,
        },
        decode={**POOL, "resources": {"splitserve_decode": 1}, "placement_timeout_s": 300},
    )
    prompts = random_prompts([180 + 7 * i for i in range(12)], VOCAB, seed=31)
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=16))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    references = [c.token_ids for c in engine.generate(prompts, params)]
    timeline: list[str] = []
    t0 = time.monotonic()

    def mark(what: str, c) -> None:
        replicas = len(c.registry.routable("prefill"))
        nodes = len(phase_nodes("splitserve_prefill"))
        timeline.append(
            f"{time.monotonic() - t0:6.1f} s  {what:<28} prefill replicas {replicas}, prefill nodes {nodes}"
        )

    waiting_seen: list[str] = []  # workers the status service showed waiting for a node

    def watch(address: str, stop: threading.Event) -> None:
        with Client(address, timeout=30) as client:
            while not stop.is_set():
                try:
                    pools = client.cluster_status().pools
                except Exception as e:  # shown by the assertion below
                    waiting_seen.append(f"status failed: {e}")
                    pools = []
                waiting_seen.extend(w.worker_id for pool in pools for w in pool.workers if w.waiting_for_node)
                time.sleep(0.1)

    with BackgroundCluster(config) as c:
        prefill = c.cluster.pools["prefill"]
        mark("started", c)
        watching = threading.Event()
        watcher = threading.Thread(target=watch, args=(c.address, watching))
        watcher.start()
        assert len(phase_nodes("splitserve_prefill")) == 1 and len(phase_nodes("splitserve_decode")) == 1
        load = Load(c.address, prompts, references, concurrency=12)
        try:
            mark("load on", c)
            wait_until(lambda: len(c.registry.routable("prefill")) == 2, "the prefill pool to grow", 180)
            mark("pool grew", c)
            assert len(phase_nodes("splitserve_prefill")) == 2  # Ray launched a node for it
            assert prefill.node_of("prefill-1") != prefill.node_of("prefill-0")
            wait_until(lambda: load.served.get("prefill-1", 0) >= 3, "the new worker to take requests", 180)
            mark("new worker serving", c)
        finally:
            load.join()
            watching.set()
            watcher.join(30)
        mark(f"load off ({load.sent} requests)", c)
        assert "prefill-1" in waiting_seen  # status showed it waiting while Ray launched its node
        wait_until(lambda: len(c.registry.routable("prefill")) == 1, "the prefill pool to shrink", 180)
        mark("pool shrank", c)
        wait_until(
            lambda: len(phase_nodes("splitserve_prefill")) == 1, "the idle prefill node to be terminated", 180
        )
        mark("idle node terminated", c)
        survivor = c.registry.routable("prefill")[0].worker_id
        assert phase_nodes("splitserve_prefill") == [prefill.node_of(survivor)]
    print("\n".join(["timeline:", *timeline]))
    assert load.failures == []
    assert sum(load.served.values()) == load.sent > 0
