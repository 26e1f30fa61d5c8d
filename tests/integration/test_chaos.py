"""The chaos harness (``splitserve.bench.chaos``) at CI size: a cluster of two
TP=2 prefill groups and two decode workers under continuous concurrent load
while prefill workers, decode workers and TP ranks are killed; every completed
output must equal the monolithic engine's greedy tokens, no call may hang, and
no KV may stay held. The large run (100+ kills) is the same harness by hand:
``python -m splitserve.bench.chaos --kills 100``."""

from __future__ import annotations

import os

from splitserve.bench.chaos import ChaosSpec, chaos_config, mixed_prompts, run_chaos
from splitserve.engine import Engine
from tests.integration.cluster_util import VOCAB, live_cluster

KILLS = int(os.environ.get("SPLITSERVE_CHAOS_KILLS", "9"))


def test_kills_under_load_lose_no_request_and_corrupt_no_output(checkpoint):
    config = chaos_config(checkpoint, prefill=2, decode=2, tp=2)
    prompts, params = mixed_prompts(24, VOCAB, seed=1, max_len=200)
    reference = [c.token_ids for c in Engine(config.engine_config("decode")).generate(prompts, params)]
    with live_cluster(config) as cluster:
        report = run_chaos(cluster, prompts, params, reference, ChaosSpec(kills=KILLS, gap_s=1.5, clients=6))
    print(report.summary())
    assert len(report.kills) == KILLS
    assert {k.kind for k in report.kills} == {"prefill", "decode", "tp_rank"}
    assert report.problems() == []
    # the prefill groups never restart (a TP group cannot): each killed one was replaced
    assert report.replaced["prefill"] == sum(k.kind != "decode" for k in report.kills)
    assert len(report.outcomes) > 2 * KILLS
