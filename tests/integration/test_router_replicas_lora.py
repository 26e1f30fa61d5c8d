"""Runtime LoRA changes on a router other than the first (``cluster.adapter_desk``):
two routers on one port (``router.replicas``) over one colocated worker of the tiny
model. Either router takes ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``;
one that runs no pools passes the change to the first through the desk, and the answer
comes once every router serves the change: the next request finds the adapter (its
tokens equal transformers + PEFT's, the adapter merged), or not (NOT_FOUND), whichever
router takes it. (A module of its own: one live cluster at a time.)"""

from __future__ import annotations

import pytest
import ray

from splitserve.client import Client
from splitserve.client.errors import NotFound
from tests.conftest import random_prompts
from tests.integration.cluster_util import VOCAB, live_cluster, post_json, tiny_config
from tests.lora_util import make_adapter, merged_greedy

pytest.importorskip("peft")

MAX_NEW = 8
ADAPTERS = {"a1": (4, 8, ["q_proj", "v_proj", "down_proj"]), "a2": (8, 4, ["k_proj", "o_proj", "up_proj"])}


@pytest.fixture(scope="module")
def two_routers(checkpoint, tmp_path_factory):
    dirs = {}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        dirs[name] = str(tmp_path_factory.mktemp(f"lora-{name}"))
        make_adapter(checkpoint, dirs[name], rank, alpha, targets, False, seed=30 + i)
    (prompt,) = random_prompts([17], VOCAB, seed=9)
    expected = {n: merged_greedy(checkpoint, d, [prompt], MAX_NEW)[0] for n, d in dirs.items()}
    assert expected["a1"] != expected["a2"]
    model = {"name": checkpoint, "dtype": "float32", "served_name": "tiny", "enable_lora": True}
    model["max_lora_rank"] = 8
    colocated = {"num_cpus": 0.5, "replicas": 1, "engine": {"kv_cache_memory_mib": 16}}
    config = tiny_config(checkpoint, "colocated", model=model, colocated=colocated)
    config = config.model_copy(update={"router": config.router.model_copy(update={"replicas": 2})})
    with live_cluster(config) as c:
        yield c, dirs, prompt, expected


def test_a_router_other_than_the_first_loads_and_unloads_adapters_for_the_cluster(two_routers):
    """Every router takes ``/v1/load_lora_adapter``: one that runs no pools passes the
    change to the first (the desk), and the answer comes once every router serves the
    change, so the next request finds the adapter (or not) whichever router takes it.
    Connections spread over the two routers; the loop goes on until each has taken a
    change (the desk counts those passed on)."""
    cluster, dirs, prompt, expected = two_routers
    base = f"http://{cluster.http_address}/v1"
    desk = cluster.cluster.replicas.desk
    answered_first = 0  # changes the first router took itself
    for round_ in range(40):
        name = ("a1", "a2")[round_ % 2]
        before = ray.get(desk.forwarded.remote(), timeout=60)
        assert post_json(f"{base}/load_lora_adapter", {"lora_name": name, "lora_path": dirs[name]})[0] == 200
        answered_first += ray.get(desk.forwarded.remote(), timeout=60) == before
        with Client(cluster.address, timeout=120) as client:  # a connection of its own: either router
            out = client.generate(prompt, model=name, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0)
            assert out.token_ids == expected[name], (round_, name)
        assert post_json(f"{base}/unload_lora_adapter", {"lora_name": name})[0] == 200
        with Client(cluster.address, timeout=120) as client, pytest.raises(NotFound, match=f"'{name}'"):
            client.generate(prompt, model=name, max_tokens=2)
        status, text = post_json(f"{base}/unload_lora_adapter", {"lora_name": name})  # either router
        assert status == 404 and f"no LoRA adapter named '{name}'" in text, (status, text)
        forwarded = ray.get(desk.forwarded.remote(), timeout=60)
        if answered_first and forwarded >= 2:
            break
    assert answered_first and forwarded >= 2, f"the first router took {answered_first}, the desk {forwarded}"
