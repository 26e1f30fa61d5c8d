"""Colocated workers, Ray actors, whose engines run in processes of their own
(``colocated.engine_process``; ``engine.process``): greedy tokens equal to the
monolithic engine's, each engine a child process of its worker's; an engine process
that dies costs its requests a resume on the other worker (tokens unchanged), and the
pool replaces its worker with one whose engine again runs in a process of its own.
A module of its own: one live cluster at a time."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    live_cluster,
    mixed_workload,
    process_exited,
    reference_tokens,
    stream_all,
    streams_through_a_fault,
    tiny_config,
    wait_kv_free,
    wait_until,
)

DEADLINE_S = 300


@pytest.fixture(scope="module")
def cluster(checkpoint):
    config = tiny_config(checkpoint, mode="colocated")
    colocated = config.colocated.model_copy(update={"engine_process": True})
    with live_cluster(config.model_copy(update={"colocated": colocated})) as c:
        yield c


def _pids(cluster) -> dict[str, tuple[int, int]]:
    """Each colocated worker's process id and its engine process's, by worker id."""
    pool = cluster.cluster.pools["colocated"]
    asks = {
        w.worker_id: pool.actors(w.worker_id)[0].__ray_call__.remote(lambda w: (os.getpid(), w.loop.pid))
        for w in pool.workers
    }
    return {wid: ray.get(ask, timeout=60) for wid, ask in asks.items()}


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _decoding(cluster, worker_id: str) -> int:
    async def read():
        record = cluster.registry.get(worker_id)
        return len(record.decoding) if record is not None else 0

    return cluster.run(read(), timeout=60)


def test_streams_equal_monolithic_greedy_from_engines_in_child_processes(cluster, reference, client):
    pids = _pids(cluster)
    assert sorted(pids) == ["colocated-0", "colocated-1"]
    for worker_pid, engine_pid in pids.values():
        assert engine_pid != worker_pid and _parent(engine_pid) == worker_pid
    prompts, params = mixed_workload(32)
    expected = reference_tokens(reference, prompts, params)
    results = stream_all(cluster.address, prompts, params)
    assert [out.token_ids for out, _ in results] == expected
    assert {out.final.decode_worker for out, _ in results} == set(pids)  # both engines served
    assert set(wait_kv_free(client).values()) == {0}


def test_a_lost_engine_process_resumes_its_requests_and_its_worker_is_replaced(cluster, reference, client):
    pool = cluster.cluster.pools["colocated"]
    pids = _pids(cluster)
    prompts = random_prompts([30, 50, 70, 20, 60, 40], VOCAB, seed=42)
    params = SamplingParams(max_tokens=800, ignore_eos=True)
    expected = reference_tokens(reference, prompts, [params] * len(prompts))
    finish = streams_through_a_fault(cluster.address, prompts, params.max_tokens)
    lost = max(pids, key=lambda w: _decoding(cluster, w))  # the worker holding the most of them
    os.kill(pids[lost][1], signal.SIGKILL)
    assert finish(DEADLINE_S) == [("OK", tokens) for tokens in expected]
    traces = client.cluster_status(traces=len(prompts)).traces
    resumed = [t for t in traces if any(m.name == "resumed" for m in t.marks)]
    assert resumed, "no request was resumed: the lost engine held none of them"
    # the pool heard its engine stopped (a poll), retired it and started another in its place
    wait_until(lambda: pool.engine_failures == 1 and len(pool.workers) == 2, "the worker was not replaced")
    now = _pids(cluster)
    assert lost not in now and len(now) == 2
    for worker_pid, engine_pid in now.values():
        assert _parent(engine_pid) == worker_pid
    wait_until(lambda: process_exited(pids[lost][0]), "the retired worker's process lives on")
    results = stream_all(cluster.address, prompts[:4], [params] * 4)
    assert [out.token_ids for out, _ in results] == expected[:4]
    assert set(wait_kv_free(client).values()) == {0}
