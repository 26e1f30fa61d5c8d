"""Admission across router replicas: at ten times the cluster's in-flight limit, spread
over two routers (connections of their own), no router holds more than its share
(``ceil(limit / 2)``), the cluster never more than the limit, and every refused request
gets RESOURCE_EXHAUSTED with a sentence while the admitted ones complete."""

from __future__ import annotations

import threading

from splitserve.client import Client, ResourceExhausted
from tests.conftest import random_prompts
from tests.integration.cluster_util import VOCAB, live_cluster, tiny_config

LIMIT = 4  # requests in flight, the whole cluster: 2 per router


def test_ten_times_the_limit_over_two_routers_holds_each_routers_share(checkpoint):
    config = tiny_config(checkpoint, "colocated", limits={"max_inflight_requests": LIMIT})
    config = config.model_copy(update={"router": config.router.model_copy(update={"replicas": 2})})
    prompts = random_prompts([30] * (10 * LIMIT), VOCAB, seed=51)
    with live_cluster(config) as cluster:
        outcomes: list[str] = []
        held: list[list[int]] = []
        done = threading.Event()

        def sample() -> None:  # what each router holds, until the load ends
            while not done.is_set():
                held.append([r.inflight for r in cluster.run(cluster.cluster.routers(), timeout=60)])

        def one(prompt) -> None:
            try:
                with Client(cluster.address, timeout=120, retries=0) as c:
                    c.generate(prompt, temperature=0, max_tokens=200, ignore_eos=True)
                outcomes.append("OK")
            except ResourceExhausted as e:
                outcomes.append("RESOURCE_EXHAUSTED" if "capacity" in str(e) else f"no sentence: {e}")
            except Exception as e:
                outcomes.append(f"{type(e).__name__}: {e}")

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        done.set()
        sampler.join(60)
    assert not any(t.is_alive() for t in threads)
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, set(outcomes)
    assert outcomes.count("OK") >= 2 and outcomes.count("RESOURCE_EXHAUSTED") >= LIMIT
    assert held and max(max(h) for h in held) <= LIMIT // 2  # each router: its share
    assert max(sum(h) for h in held) <= LIMIT
