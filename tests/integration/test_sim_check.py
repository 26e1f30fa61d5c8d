"""The cluster simulator against the real cluster, at CI's size: ``plan profile``
measures a live cluster (tiny model, one prefill and one decode worker, KV over
NIXL) through the SDK, and the same Poisson trace, sent to the cluster and run
in the simulator with that profile, gives median TPOT within a factor of two
and median TTFT (a few ms of overhead for this model) within a factor of
three. (The 25 % agreement at two rates with the real model is ``python -m
splitserve.bench.sim_check``, quoted in docs/autoscaling.md; a 2-core CI runner
sharing its cores with the client is too noisy to hold that here.)"""

from __future__ import annotations

import argparse

import pytest

from splitserve.bench import sim_check
from splitserve.cli.plan import add_profile_arguments, main_profile
from splitserve.cluster import profiling
from splitserve.cluster.simulator import SimProfile
from tests.integration.cluster_util import live_cluster, tiny_config

PLAN = profiling.ProfilePlan(
    prompt_lens=(16, 64, 128, 200),
    prefill_repeats=3,
    batches=(1, 4),
    decode_output_len=24,
    max_batched_tokens=256,
)


@pytest.fixture(scope="module")
def cluster(checkpoint):
    with live_cluster(tiny_config(checkpoint)) as c:
        yield c


def test_a_profile_is_measured_and_written(cluster, tmp_path):
    profile, m = profiling.profile(cluster.address, PLAN)
    assert len(m.prefill) == len(PLAN.prompt_lens) * PLAN.prefill_repeats
    assert [b for b, _ in m.decode] == list(PLAN.batches) * PLAN.decode_repeats
    assert profile.prefill_tokens_per_s > 0 and sum(profile.decode_step_s) > 0
    assert m.decode_shared and m.prefill_shared  # the interference probes ran
    # the CLI writes what the simulator reads back
    out = tmp_path / "profile.json"
    args = _profile_args(cluster.address, out)
    assert main_profile(args) == 0
    assert SimProfile.from_json(out.read_text()).max_batch > 0


def test_the_simulator_predicts_the_cluster_within_a_factor_of_two(cluster):
    profile, _ = profiling.profile(cluster.address, PLAN)
    rows = sim_check.check(
        cluster.address,
        profile,
        (1, 1),
        rates=[4.0],
        num_prompts=40,
        input_len=100,
        output_len=20,
        range_ratio=0.5,
    )
    by_metric = {r.metric: r for r in rows}
    assert set(by_metric) == {"p50 TTFT", "p90 TTFT", "p50 TPOT", "p90 TPOT"}
    # The tiny model's TTFT is a few ms of overhead, noisy on a shared 2-core
    # runner: a factor of three there, two for the steadier decode step.
    for name, factor in (("p50 TTFT", 3.0), ("p50 TPOT", 2.0)):
        r = by_metric[name]
        assert 1 / factor <= r.ratio <= factor, (
            f"{name}: simulated {r.simulated_ms:.1f} ms, measured {r.measured_ms:.1f} ms"
        )


def _profile_args(address: str, out) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_profile_arguments(p)
    return p.parse_args(
        [
            "--server",
            address,
            "--out",
            str(out),
            "--prompt-lens",
            "16",
            "64",
            "--repeats",
            "1",
            "--batches",
            "1",
            "2",
        ]
    )
