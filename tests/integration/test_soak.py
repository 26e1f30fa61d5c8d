"""The soak harness (``splitserve.bench.soak``) at CI size: concurrent greedy
requests with shared prefixes, a KV cache small enough that the engines preempt,
and cancels; every completed output equals the monolithic engine's and every
cancelled one is a prefix of it; no KV stays held. Run twice on one cluster:
what a process grows by in the second round must be well under what it grew in
the first (caches that fill once, e.g. oneDNN's per-shape primitives, level off;
a leak per request grows the same in both). The large run (5,000+ requests) is
the same harness by hand: ``python -m splitserve.bench.soak --requests 5000``."""

from __future__ import annotations

import os

from splitserve.bench.soak import SoakSpec, run_soak, shared_prefix_prompts, soak_config
from splitserve.engine import Engine
from tests.integration.cluster_util import VOCAB, live_cluster

REQUESTS = int(os.environ.get("SPLITSERVE_SOAK_REQUESTS", "600"))


def test_every_token_of_a_soak_is_right_and_nothing_leaks(checkpoint):
    config = soak_config(checkpoint, kv_mib=1)
    prompts, params = shared_prefix_prompts(
        64, VOCAB, seed=3, prefixes=4, prefix_len=64, max_suffix=48, max_output=160
    )
    reference = [c.token_ids for c in Engine(config.engine_config("decode")).generate(prompts, params)]
    with live_cluster(config) as cluster:
        rounds = [
            run_soak(cluster, prompts, params, reference, SoakSpec(REQUESTS, concurrency=32, seed=seed))
            for seed in (0, 1)
        ]
    for report in rounds:
        print(report.summary())
        assert len(report.outcomes) == REQUESTS
        assert report.codes["CANCELLED"] > 0  # cancels were part of the load
        assert report.problems(max_growth_mib=float("inf")) == []  # no wrong token, no failure, no KV held
    assert rounds[1].preemptions > rounds[0].preemptions > 0  # the engines ran short of blocks
    first, second = ({m.name: m for m in r.memory} for r in rounds)
    assert {name.split("[")[0] for name in second} >= {"router+clients", "PrefillWorker", "DecodeWorker"}
    for name, m in second.items():
        assert m.growth <= 0.6 * first[name].growth + 16, (name, first[name], m)
