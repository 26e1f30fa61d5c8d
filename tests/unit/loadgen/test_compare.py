"""``splitserve bench compare --splits``: the pool splits it builds are valid
serving configs that share the same cores among P + D workers."""

from __future__ import annotations

import argparse

import pytest

from splitserve.cluster.config import CONFIG_DIR, ClusterConfig
from splitserve.loadgen.compare import parse_split, split_config

BASE = str(CONFIG_DIR / "bench_disaggregated.yaml")


@pytest.mark.parametrize(
    ("split", "prefill_cores", "decode_cores", "share"),
    [((1, 1), [0], [1], 1.0), ((2, 1), [0, 1], [0], 0.666), ((1, 2), [0], [1, 0], 0.666)],
)
def test_a_split_shares_the_base_configs_cores_among_its_workers(
    tmp_path, split, prefill_cores, decode_cores, share
):
    p, d = split
    cfg = ClusterConfig.load(split_config(BASE, p, d, None, tmp_path))
    base = ClusterConfig.load(BASE)
    assert (cfg.prefill.replicas, cfg.decode.replicas) == (p, d)
    assert (cfg.prefill.cpu_ids, cfg.decode.cpu_ids) == (prefill_cores, decode_cores)
    assert cfg.prefill.num_cpus == cfg.decode.num_cpus == share
    assert p * share + d * share <= 2  # Ray can place every worker on the 2 cores
    assert cfg.model == base.model and cfg.transfer == base.transfer  # the rest is the base config


def test_splits_are_parsed_and_bad_ones_refused_clearly(tmp_path):
    assert parse_split("2:1") == (2, 1)
    for bad in ("2", "0:1", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError, match="PREFILL:DECODE|at least one"):
            parse_split(bad)
    colocated = str(CONFIG_DIR / "bench_colocated.yaml")
    with pytest.raises(ValueError, match="disaggregated config"):
        split_config(colocated, 1, 1, None, tmp_path)


def test_engine_options_reach_every_pool_of_every_setup(tmp_path):
    from splitserve.loadgen.compare import parse_engine_options, setups

    options = parse_engine_options(["kv_cache_memory_mib=128", "host_kv_tier_mib=1024"])
    assert options == {"kv_cache_memory_mib": 128, "host_kv_tier_mib": 1024}
    args = argparse.Namespace(
        colocated=str(CONFIG_DIR / "bench_colocated.yaml"),
        disaggregated=[BASE, str(CONFIG_DIR / "bench_disaggregated_tier.yaml")],
        splits=[],
        cores=None,
        engine=[options],
        policy=[parse_engine_options(["local_prefill_max_stall_ms=2000"])],
    )
    found = setups(args, tmp_path)
    assert list(found) == ["colocated", "bench_disaggregated", "bench_disaggregated_tier"]
    for label, path in found.items():
        cfg = ClusterConfig.load(path)
        for role in cfg.pools():
            engine = cfg.engine_config(role)
            assert (engine.kv_cache_memory_mib, engine.host_kv_tier_mib) == (128, 1024), (label, role)
        assert cfg.policy.local_prefill_max_stall_ms == 2000, label
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_engine_options(["host_kv_tier_mib"])
    tier = ClusterConfig.load(CONFIG_DIR / "bench_colocated_tier.yaml").engine_config("colocated")
    assert tier.host_kv_tier_mib == 1024
