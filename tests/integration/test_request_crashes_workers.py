"""A request that takes down every worker it reaches is stopped after two: a real
cluster (tiny model, one prefill and three decode workers), the request's decode
worker killed (``ray.kill``) each time it holds the request. After the first loss
the router resumes it on another worker, as any request; after the second it ends
with ``INTERNAL`` and a sentence naming its fingerprint, and is not tried on the
third worker. Requests that were on the second worker with it resume on the
third and equal the monolithic engine's greedy tokens; no KV stays held.

Its old flake (1 run in 9, then 2 in 13: a good request ended INTERNAL) was the
router counting a failed *start* on the first worker, dead but still routable
while Ray restarted it, as a loss the request was present at; a start that fails
now takes that worker out of routing and counts as no loss (``WorkerUnreachable``).
After that fix, 7 of 8 runs passed (the failing run's cause was not captured);
with the redirect of a failed start and the timeout-safe polls, 20 of 20 by hand
(a loop of ``pytest tests/integration/test_request_crashes_workers.py``, 16-21 s
each): it runs in CI."""

from __future__ import annotations

import threading

import grpc
import pytest
import ray

from splitserve.client import Client, ServerError
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster_util import (
    VOCAB,
    live_cluster,
    reference_tokens,
    tiny_config,
    wait_kv_free,
    wait_until,
)

ENGINE = {"kv_cache_memory_mib": 16, "max_num_batched_tokens": 256}
GOOD = SamplingParams(max_tokens=300, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(checkpoint):
    config = tiny_config(
        checkpoint,
        prefill={"num_cpus": 0.25, "engine": ENGINE},
        decode={"num_cpus": 0.25, "replicas": 3, "engine": ENGINE},
    )
    with live_cluster(config) as c:
        yield c


def _holder(cluster, request_id: str) -> str | None:
    """The decode worker the router has ``request_id`` open on, if any."""

    async def read():
        return next(
            (w.worker_id for w in cluster.registry.workers("decode") if request_id in w.decoding), None
        )

    return cluster.run(read(), timeout=60)


def test_a_request_on_two_lost_workers_ends_with_internal_and_the_others_resume(cluster, reference):
    pool = cluster.cluster.pools["decode"]
    poison = random_prompts([40], VOCAB, seed=41)[0]
    good = random_prompts([30, 50, 70, 20, 60, 40], VOCAB, seed=42)
    expected = reference_tokens(reference, good, [GOOD] * len(good))
    outcome: dict = {}
    killed: list[str] = []

    def run_poison() -> None:
        with Client(cluster.address, timeout=300) as c:
            try:
                c.generate(poison, request_id="poison", max_tokens=900, temperature=0, ignore_eos=True)
                outcome["poison"] = "completed"
            except ServerError as e:
                outcome["poison"] = e

    got: list = [None] * len(good)

    def run_good(i: int) -> None:
        with Client(cluster.address, timeout=300) as c:
            try:
                got[i] = c.generate(
                    good[i], max_tokens=GOOD.max_tokens, temperature=0, ignore_eos=True
                ).token_ids
            except Exception as e:  # shown by the assertion below
                got[i] = repr(e)

    poison_thread = threading.Thread(target=run_poison)
    poison_thread.start()
    # first loss: the worker holding the request dies; the router resumes it elsewhere
    wait_until(lambda: _holder(cluster, "poison") is not None, "the request never reached a decode worker")
    first = _holder(cluster, "poison")
    ray.kill(pool.actors(first)[0], no_restart=False)
    killed.append(first)
    wait_until(lambda: _holder(cluster, "poison") not in (None, first), "the request was not resumed")
    second = _holder(cluster, "poison")
    # requests that share the second worker with it (and the third)
    threads = [threading.Thread(target=run_good, args=(i,)) for i in range(len(good))]
    for t in threads:
        t.start()
    wait_until(lambda: _holder_count(cluster, second) > 1, "no other request joined the second worker")
    ray.kill(pool.actors(second)[0], no_restart=False)
    killed.append(second)
    for t in [poison_thread, *threads]:
        t.join(600)  # the clients' own deadlines (300 s) end them first
    if any(t.is_alive() for t in [poison_thread, *threads]):
        pytest.fail(f"a request did not end: {got}; the router's traces: {_traces(cluster)}")
    error = outcome["poison"]
    assert isinstance(error, ServerError), error
    assert error.code == grpc.StatusCode.INTERNAL and "fingerprint" in error.details
    assert "2 workers that were lost" in error.details
    if got != expected:  # the others resumed on the third worker, exactly
        ended = [g if isinstance(g, str) else "ok" if g == e else "wrong" for g, e in zip(got, expected)]
        pytest.fail(f"the good requests ended {ended}; the router's traces: {_traces(cluster)}")
    third = ({"decode-0", "decode-1", "decode-2"} - set(killed)).pop()
    assert _holder(cluster, "poison") is None
    with Client(cluster.address, timeout=60) as c:
        assert set(wait_kv_free(c, timeout=60).values()) == {0}  # nothing held anywhere
        # the third worker never saw the request: its engine failed nothing and it was not lost
        status = {w.worker_id: w for p in c.cluster_status().pools for w in p.workers}
        assert status[third].alive and status[third].restarts == 0


def _holder_count(cluster, worker_id: str) -> int:
    async def read():
        return len(cluster.registry.get(worker_id).decoding)

    return cluster.run(read(), timeout=60)


def _traces(cluster) -> list:
    """The router's last traces, each as (request id, outcome, [(mark, worker)])."""
    with Client(cluster.address, timeout=60) as c:
        traces = c.cluster_status(traces=20).traces
    return [(t.request_id, t.outcome, [(m.name, m.worker) for m in t.marks]) for t in traces]
