"""The SLO planner for real, at small scale: a prompt-heavy load step makes it add
a prefill worker (and not a decode one), an output-heavy step a decode worker
(and not a prefill one); after each step it drains the extra worker again, and
no request fails. Real Ray actors, the real router, KV over NIXL, the tiny model.

The targets are set so that each step binds one pool only: a TTFT target of
300 ms against ~900-token prompts from 4 clients at once, and a TPOT target of
1 ms, below any decode step's duration (one sequence per worker meets it, so
decode capacity is one stream per worker); the prompt-heavy step asks for one
output token (no TPOT), the output-heavy one sends 8-token prompts."""

from __future__ import annotations

import threading

import pytest

from splitserve.client import Client
from tests.conftest import random_prompts, tiny_checkpoint
from tests.integration.cluster_util import VOCAB, live_cluster, tiny_config
from tests.waiting import wait_until

AUTOSCALING = {"policy": "slo", "min_replicas": 1, "max_replicas": 2, "drain_timeout_s": 120}
PLANNER = {
    "ttft_ms": 300,
    "tpot_ms": 1,
    "interval_s": 1.0,
    "downscale_delay_s": 3,
    "min_reversal_s": 3,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    engine = {"kv_cache_memory_mib": 16, "max_num_seqs": 8, "max_num_batched_tokens": 256}
    pool = {"num_cpus": 0.5, "engine": engine, "autoscaling": AUTOSCALING}
    config = tiny_config(tiny_checkpoint(tmp_path_factory), prefill=pool, decode=pool, planner=PLANNER)
    with live_cluster(config) as c:
        yield c


class Load:
    """``n`` clients, each sending one request after another until stopped."""

    def __init__(self, address: str, n: int, prompt_len: int, max_tokens: int):
        self.done, self.errors = 0, []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(address, i, prompt_len, max_tokens)) for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def _run(self, address: str, i: int, prompt_len: int, max_tokens: int) -> None:
        with Client(address, timeout=300) as c:
            seed = 1000 * i
            while not self._stop.is_set():
                seed += 1
                prompt = random_prompts([prompt_len], VOCAB, seed=seed)[0]
                try:
                    out = c.generate(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True)
                    assert len(out.token_ids) == max_tokens
                    self.done += 1
                except Exception as e:  # counted, and the test fails on any
                    self.errors.append(e)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def routable(cluster, role: str) -> int:
    return cluster.run(_count(cluster, role))


async def _count(cluster, role: str) -> int:
    return len(cluster.registry.routable(role))


def wait_for(cluster, role: str, n: int, timeout: float = 300) -> None:
    wait_until(lambda: routable(cluster, role) == n, f"the {role} pool reaches {n} workers", timeout)


def targets(cluster, role: str, since: int) -> list[int]:
    """What the planner scaled ``role`` to, decision by decision, from decision ``since`` on."""
    return [getattr(d, role).target for d in cluster.cluster.planner.decisions[since:]]


@pytest.mark.parametrize(
    ("grows", "stays", "prompt_len", "max_tokens"),
    [("prefill", "decode", 900, 1), ("decode", "prefill", 8, 60)],
    ids=["prompt-heavy", "output-heavy"],
)
def test_a_load_step_grows_the_pool_the_slo_needs_then_drains_it(
    cluster, grows, stays, prompt_len, max_tokens
):  # noqa: E501
    wait_for(cluster, grows, 1)  # the previous case has drained
    since = len(cluster.cluster.planner.decisions)
    load = Load(cluster.address, 4, prompt_len, max_tokens)
    try:
        wait_for(cluster, grows, 2)
        assert routable(cluster, stays) == 1
    finally:
        load.stop()
    during = targets(cluster, stays, since)
    wait_for(cluster, grows, 1)  # drained once the load is gone
    last = cluster.cluster.planner.decisions[-1]
    print(f"{grows} step: {load.done} requests; {stays} targets {during}; {getattr(last, grows).reason}")
    for d in cluster.cluster.planner.decisions[since:]:  # why the other pool moved, if it did
        print(f"  {stays}: {getattr(d, stays).target} ({getattr(d, stays).reason})")
    assert load.errors == [] and load.done > 0
    assert set(during) == {1}  # the other pool was never asked to grow
