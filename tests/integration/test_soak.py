"""The soak harness (``splitserve.bench.soak``) at CI size: concurrent greedy
requests with shared prefixes, a KV cache small enough that the engines preempt,
and cancels; every completed output equals the monolithic engine's and every
cancelled one is a prefix of it; no KV stays held. Run twice on one cluster,
the second round may add at most 160 MiB to any process: a guard against a gross
leak (~270 KB per request or more), not a flatness test. At this size the decode
worker's caches (oneDNN's per-shape primitives among them) are still filling,
+65-86 MiB in the second round, and the prefill worker's growth varies from run
to run (0-84 MiB in the first round), so a ratio between rounds flaked. Whether
memory is flat is the large run's figure (``docs/reliability.md``):
``python -m splitserve.bench.soak --requests 5000``."""

from __future__ import annotations

import os

from splitserve.bench.soak import SoakSpec, run_soak, shared_prefix_prompts, soak_config
from splitserve.engine.engine import Engine
from tests.integration.cluster_util import VOCAB, live_cluster

REQUESTS = int(os.environ.get("SPLITSERVE_SOAK_REQUESTS", "400"))


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
    second = rounds[1].memory
    assert {m.name.split("[")[0] for m in second} >= {"router+clients", "PrefillWorker", "DecodeWorker"}
    assert all(m.growth <= 160 for m in second), second
