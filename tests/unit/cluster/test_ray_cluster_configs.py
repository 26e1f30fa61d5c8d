"""The `ray up` cluster YAMLs under cluster_configs/ray/ and the KubeRay manifest:
each passes Ray's own cluster-config validation (the schema that ships with the
installed Ray, after Ray fills in its provider defaults: a broken YAML fails
here with Ray's message), and the phase resources each node type (or worker
group) advertises are exactly those the pools of its paired serving config ask
for, with room for at least one worker of each pool per node."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.commands import prepare_config
from ray.autoscaler._private.util import validate_config

from splitserve.cluster.app import RAY_SYSTEM_CONFIG
from splitserve.cluster.config import CONFIG_DIR, ClusterConfig

RAY_DIR = CONFIG_DIR / "ray"
# cluster YAML -> the serving config to run on it
PAIRS = {
    "aws.yaml": "aws.yaml",
    "gcp.yaml": "gcp.yaml",
    "local.yaml": "onprem.yaml",
    "kuberay.yaml": "kuberay.yaml",
}
PHASE_PREFIX = "splitserve_"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def pool_demands(serving: ClusterConfig) -> dict[str, float]:
    """Phase resource -> units one worker of the pool asking for it reserves."""
    out: dict[str, float] = {}
    for pool in serving.pools().values():
        for name, amount in pool.resources.items():
            out[name] = max(out.get(name, 0.0), amount * pool.tp_size)
    return out


def test_every_cluster_yaml_is_paired_with_a_serving_config():
    assert sorted(p.name for p in RAY_DIR.glob("*.yaml")) == sorted(PAIRS)
    for serving in PAIRS.values():
        config = ClusterConfig.load(CONFIG_DIR / serving)
        assert config.ray.address == "auto"
        assert all(pool.resources for pool in config.pools().values()), f"{serving}: a pool with no phase"


@pytest.mark.parametrize("name", [n for n in PAIRS if n != "kuberay.yaml"])
def test_ray_validates_the_cluster_yaml(name):
    validate_config(prepare_config(load(RAY_DIR / name)))


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_node_types_advertise_what_the_pools_ask_for(name):
    cluster = load(RAY_DIR / name)
    serving = ClusterConfig.load(CONFIG_DIR / PAIRS[name])
    router = serving.router.node_resource
    advertised: dict[str, float] = {}
    routers = 0  # node types that run a router of their own
    for node_type in cluster["available_node_types"].values():
        for res, units in node_type["resources"].items():
            if res == router:
                routers += units >= 1
            elif res.startswith(PHASE_PREFIX):
                advertised[res] = max(advertised.get(res, 0.0), units)
    assert routers, f"{name}: no node type runs a router ({router})"
    demands = pool_demands(serving)
    assert advertised.keys() == demands.keys()
    for res, need in demands.items():
        assert advertised[res] >= need, f"{name}: no node type holds one worker asking {need} {res}"
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert not any(r.startswith(PHASE_PREFIX) for r in head["resources"]), "the head runs no worker"


def test_on_premises_hosts_advertise_their_phase_from_a_file():
    cluster = load(RAY_DIR / "local.yaml")
    for command in (cluster["head_start_ray_commands"][-1], cluster["worker_start_ray_commands"][-1]):
        assert "--resources=" in command and ".splitserve_resources" in command
    demands = pool_demands(ClusterConfig.load(CONFIG_DIR / PAIRS["local.yaml"]))
    assert demands.keys() == {"splitserve_prefill", "splitserve_decode"}


def test_kuberay_worker_groups_advertise_what_the_pools_ask_for():
    manifest = load(RAY_DIR / "kuberay.yaml")
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayCluster")
    spec = manifest["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    serving = ClusterConfig.load(CONFIG_DIR / PAIRS["kuberay.yaml"])
    advertised: dict[str, float] = {}
    routers = 0  # groups whose pods run a router of their own
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
        gpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        routers += resources.pop(serving.router.node_resource, 0) >= 1
        for res, units in resources.items():
            assert res.startswith(PHASE_PREFIX)
            assert units == gpus, f"group {group['groupName']}: one {res} unit per GPU"
            advertised[res] = units
    assert routers, "no worker group runs a router"
    demands = pool_demands(serving)
    assert advertised.keys() == demands.keys()
    assert all(advertised[r] >= need for r, need in demands.items())


def test_a_broken_cluster_yaml_fails_with_rays_message():
    broken = load(RAY_DIR / "aws.yaml")
    broken["available_node_types"]["prefill_h100"]["min_workers"] = "two"
    with pytest.raises(Exception, match="'two' is not of type 'integer'"):
        validate_config(prepare_config(broken))


def _system_config(command: str) -> dict:
    flag = next(a for a in shlex.split(command) if a.startswith("--system-config="))
    return json.loads(flag.removeprefix("--system-config="))


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml", "local.yaml"])
def test_head_nodes_start_ray_with_the_settings_a_local_instance_gets(name):
    head = load(RAY_DIR / name)["head_start_ray_commands"][-1]
    assert _system_config(head.split(";")[-1]) == RAY_SYSTEM_CONFIG


def test_the_kuberay_head_starts_ray_with_the_settings_a_local_instance_gets():
    params = load(RAY_DIR / "kuberay.yaml")["spec"]["headGroupSpec"]["rayStartParams"]
    assert json.loads(params["system-config"]) == RAY_SYSTEM_CONFIG
