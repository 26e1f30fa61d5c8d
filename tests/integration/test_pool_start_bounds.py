"""A TP group's start is bounded where Ray may never answer: its ranks meet through a
task run in its placement group, and a group whose node died under it waits there
for Ray to place it again, which may never come (a chaos run's prefill pool never
recovered: the wait had no end). The start fails with a sentence instead, and what
it held is let go, so the pool's next try can start afresh."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from ray.util.placement_group import placement_group_table

from splitserve.cluster import pools
from splitserve.router.registry import WorkerRegistry
from splitserve.router.roles import Role
from tests.integration.cluster_util import shared_ray, tiny_config, wait_until


@pytest.fixture(scope="module", autouse=True)
def _ray():
    shared_ray()


def test_a_group_whose_ranks_never_meet_fails_its_start_and_lets_go_of_its_placement(tmp_path, monkeypatch):
    def never_answers() -> str:  # as the task of a group whose node is gone: it never runs
        time.sleep(3600)
        return ""

    monkeypatch.setattr(pools, "_rendezvous_address", never_answers)
    # raising=False: the test also runs (and fails, at its own bound) on code without the bound
    monkeypatch.setattr(pools, "RENDEZVOUS_TIMEOUT_S", 2.0, raising=False)
    config = tiny_config(str(tmp_path), prefill={"num_cpus": 0.25, "tp_size": 2})
    registry = WorkerRegistry()
    pool = pools.WorkerPool(Role.PREFILL, config, registry)
    started = []
    real_pg = pools.placement_group

    def recording(*args, **kwargs):
        started.append(real_pg(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(pools, "placement_group", recording)

    async def start() -> None:
        await asyncio.wait_for(pool.add(1), 60)  # the test's own bound: far past the start's

    with pytest.raises(RuntimeError, match="ranks could not meet"):
        asyncio.run(start())
    assert registry.workers(Role.PREFILL) == [] and not pool.has("prefill-0")
    (pg,) = started
    wait_until(lambda: placement_group_table(pg)["state"] == "REMOVED", "its placement group removed", 60)
    assert ray.available_resources().get("CPU", 0) > 0  # nothing of it holds the CPUs
