"""Per-phase autoscaling on a live disaggregated cluster: the decode pool grows
under decode load, the new worker takes traffic, and removing a worker while
it streams drops nothing (drain, its requests moved to the other worker by
live migration, then kill). One Ray instance for the module."""

from __future__ import annotations

import threading

import pytest
import ray

from splitserve.client import Client
from splitserve.cluster.autoscale import ScaleDecision
from tests.conftest import random_prompts, tiny_checkpoint
from tests.integration.cluster_util import VOCAB, live_cluster, tiny_config, wait_kv_free
from tests.waiting import wait_until

LONG = 700  # output tokens of the load requests


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    engine = {"kv_cache_memory_mib": 16, "max_num_seqs": 8}
    config = tiny_config(
        tiny_checkpoint(tmp_path_factory),
        prefill={"num_cpus": 0.5, "engine": engine},
        decode={
            "num_cpus": 0.5,
            "engine": engine,
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 2,
                "target": 0.3,
                "interval_s": 0.2,
                "upscale_delay_s": 0.4,
                "downscale_delay_s": 3600,  # this test removes a worker itself
            },
        },
    )
    with live_cluster(config) as c:
        yield c


class Load:
    """``n`` client threads, each sending one long request after another until stopped."""

    def __init__(self, address: str, n: int):
        self.results, self.errors = [], []
        self.sent: dict[str, tuple[list[int], int]] = {}  # request id -> (prompt, seed)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(address, i)) for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, address: str, i: int) -> None:
        with Client(address, timeout=300) as c:
            seed = 100 * i
            while not self._stop.is_set():
                seed += 1
                prompt, rid = random_prompts([12], VOCAB, seed=seed)[0], f"load-{seed}"
                self.sent[rid] = (prompt, seed)
                try:
                    self.results.append(c.generate(prompt, request_id=rid, **sampled(seed)))
                except Exception as e:  # any failure is a dropped request
                    self.errors.append(e)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


def sampled(seed: int) -> dict:
    """A long seeded (temperature 1) request's options: reproducible, and not greedy."""
    return dict(max_tokens=LONG, ignore_eos=True, temperature=1.0, seed=seed)


def _wait(cond, what: str) -> None:
    wait_until(cond, what, timeout=180, every=0.05)


def test_decode_pool_grows_under_load_and_drains_without_dropping(cluster):
    scaler = cluster.cluster.autoscalers["decode"]
    load = Load(cluster.address, 8)  # 8 streams on a worker of 8 seqs: load ~1.0 > target 0.3
    try:
        _wait(lambda: len(cluster.registry.routable("decode")) == 2, "the decode pool did not grow")
        assert scaler.events[-1][1] == 2
        new = cluster.registry.workers("decode")[1]
        assert new.worker_id == "decode-1"
        _wait(lambda: new.active >= 2, "the new worker got no requests")
        # From here the policy allows one worker (the load would grow the pool again).
        scaler.decision = ScaleDecision(scaler.spec.model_copy(update={"max_replicas": 1}))
        # Scale down while it streams: it leaves routing at once, and is killed once idle.
        cluster.run(scaler.remove(new.worker_id), timeout=180)
    finally:
        load.stop()
    assert load.errors == []
    assert all(r.final.finish_reason == "length" and len(r.token_ids) == LONG for r in load.results)
    with Client(cluster.address) as c:  # the drain (autoscaling.drain: migrate) moved decode-1's off
        traces = c.cluster_status(traces=100).traces
    assert any(m.name == "moved" for t in traces for m in t.marks)
    assert [w.worker_id for w in scaler.pool.workers] == ["decode-0"]
    assert [w.worker_id for w in cluster.registry.workers("decode")] == ["decode-0"]
    assert scaler.events[-1][1] == 1
    with Client(cluster.address) as c:
        assert wait_kv_free(c) == {"prefill-0": 0, "decode-0": 0}


def test_streams_on_a_lost_decode_worker_continue_elsewhere(cluster):
    """A decode worker killed mid-stream: its requests continue on another decode
    worker (which prefills prompt + tokens already sent); clients see complete,
    unrepeated outputs and no error, and each resumed (seeded, sampled) request's
    tokens equal those of the same request run again undisturbed."""
    scaler = cluster.cluster.autoscalers["decode"]
    if len(cluster.registry.routable("decode")) < 2:
        cluster.run(scaler.add(), timeout=180)
    victim = cluster.registry.workers("decode")[-1]
    load = Load(cluster.address, 6)
    try:
        # decoding there (as polled), not just sent: a request whose start it has not
        # answered yet never ran there, and goes elsewhere as redirected, not resumed
        _wait(lambda: victim.running >= 2, "the second worker decodes no requests")
        streaming_on_victim = victim.running
        ray.kill(victim.client.actor, no_restart=True)
        # Let the load run on after the kill until the router has seen the worker gone.
        _wait(lambda: not victim.alive or victim.active == 0, "the router never noticed the lost worker")
    finally:
        load.stop()
    assert streaming_on_victim >= 2
    assert load.errors == []
    assert all(r.final.finish_reason == "length" and len(r.token_ids) == LONG for r in load.results)
    with Client(cluster.address) as c:
        used = wait_kv_free(c)
        traces = c.cluster_status(traces=100).traces
        resumed = {t.request_id for t in traces if any(m.name == "resumed" for m in t.marks)}
        assert len(resumed) >= 2
        for r in load.results:
            if r.request_id in resumed:
                prompt, seed = load.sent[r.request_id]
                assert c.generate(prompt, **sampled(seed)).token_ids == r.token_ids, r.request_id
    assert all(v == 0 for k, v in used.items() if k != victim.worker_id)
