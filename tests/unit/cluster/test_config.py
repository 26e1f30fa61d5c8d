"""The serving config: defaults, the shipped YAMLs, and clear errors."""

import dataclasses

import pytest

from splitserve.cluster.config import CONFIG_DIR, ClusterConfig, describe


def test_local_yaml_is_the_default():
    assert ClusterConfig.load() == ClusterConfig()
    assert ClusterConfig.load(CONFIG_DIR / "local.yaml").mode == "disaggregated"


def test_every_shipped_config_loads():
    paths = sorted(CONFIG_DIR.glob("*.yaml"))
    assert paths
    for path in paths:
        ClusterConfig.load(path)
    assert ClusterConfig.load(CONFIG_DIR / "colocated.yaml").pools().keys() == {"colocated"}


def test_every_field_is_described():
    from pydantic import BaseModel

    def missing(model):
        for name, f in model.model_fields.items():
            if not f.description:
                yield f"{model.__name__}.{name}"
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                yield from missing(f.annotation)

    assert list(missing(ClusterConfig)) == []
    assert any(line.strip().startswith("backend: KV transfer backend") for line in describe())


@pytest.mark.parametrize(
    "text, needle",
    [
        ("mode: both\n", "mode"),
        ("prefill: {replicas: 0}\n", "at least one prefill"),
        ("decode: {engine: {block_size: 32}}\n", "same block_size"),
        ("transfer: {backend: carrier-pigeon}\n", "backend"),
        ("decode: {tp_size: 0}\n", "tp_size"),
        ("decode: {engine: {quantization: int4}}\n", "quantization"),
        ("decode: {engine: {cuda_graphs: true}}\n", "needs engine.attention_backend: triton"),
        ("router: {tls_cert: a.pem}\n", "tls_key"),
        ("prefill: {resources: {GPU: 1}}\n", "reserve GPU with num_cpus / num_gpus"),
        ("decode: {resources: {splitserve_decode: 0}}\n", "resources.splitserve_decode must be positive"),
        ("decode: {placement_timeout_s: 0}\n", "placement_timeout_s"),
        ("decode: {env: {'A=B': '1'}}\n", "env: 'A=B' is not an environment variable's name"),
        ("limits: {max_inflight_requests: 0}\n", "max_inflight_requests"),
        ("modle: {name: x}\n", "modle"),
        ("router: {chat_template: /nonexistent/template.jinja}\n", "router.chat_template: no file"),
        ("router: {openai: {tool_call_parser: xml}}\n", "tool_call_parser"),
        ("model: [unclosed\n", "not valid YAML"),
        ("decode: {engine_process: true}\n", "engine_process is for colocated pools"),
        ("mode: colocated\ncolocated: {engine_process: true, tp_size: 2}\n", "engine_process needs tp_size"),
    ],
)
def test_invalid_configs_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        ClusterConfig.load(path)


def test_quantization_is_chosen_per_pool(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text("prefill: {engine: {quantization: fp8}}\ndecode: {engine: {quantization: int8}}\n")
    config = ClusterConfig.load(path)
    assert config.engine_config("prefill").quantization == "fp8"
    assert config.engine_config("decode").quantization == "int8"
    colocated = ClusterConfig.model_validate({"mode": "colocated"})
    assert colocated.engine_config("colocated").quantization == "none"


def test_mtp_on_one_pool_runs_the_layer_on_every_pool_and_needs_no_parallelism():
    """The MTP layer's KV is a layer of the handed-over KV: a decode pool proposing with
    it makes the prefill pool run it too; tensor or expert parallelism on any pool is
    refused at load, with a sentence."""
    mtp = {"engine": {"speculative": {"method": "mtp", "num_tokens": 1}}}
    config = ClusterConfig.model_validate({"decode": mtp})
    prefill, decode = config.engine_config("prefill"), config.engine_config("decode")
    assert prefill.runs_mtp and prefill.speculative is None  # runs the layer, proposes nothing
    assert decode.runs_mtp and decode.speculative.method == "mtp"
    plain = ClusterConfig.model_validate({"decode": {"engine": {"speculative": {"method": "ngram"}}}})
    assert not plain.engine_config("prefill").mtp_layer and not plain.engine_config("decode").runs_mtp
    with pytest.raises(ValueError, match="needs tp_size and ep_size 1 on each"):
        ClusterConfig.model_validate({"decode": mtp, "prefill": {"tp_size": 2}})


def test_no_default_is_written_twice():
    """Engine fields take EngineConfig's defaults (no literal in the config models), the
    router reads LimitsSpec/PolicySpec themselves, and the worker specs leave what the
    config sets without a default."""
    import ast
    import dataclasses

    from splitserve.cluster import config as config_mod
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.decode import DecodeWorkerSpec
    from splitserve.wire.prefill import PrefillWorkerSpec

    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} | {"name"}
    literal = []
    for node in ast.walk(ast.parse(open(config_mod.__file__).read())):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            call = node.value
            if node.target.id in engine_fields and isinstance(call, ast.Call) and call.args:
                if isinstance(call.args[0], ast.Constant):
                    literal.append(node.target.id)
    assert literal == [], f"engine defaults written again in cluster/config.py: {literal}"
    # The default cluster gives every worker EngineConfig's own defaults.
    built = ClusterConfig().engine_config("prefill")
    assert built == EngineConfig(model=built.model)
    for spec, names in (
        (PrefillWorkerSpec, {"lease_s"}),
        (DecodeWorkerSpec, {"transfer_timeout_s", "max_admission_queue"}),
    ):
        for f in dataclasses.fields(spec):
            if f.name in names:
                assert f.default is dataclasses.MISSING, f"{spec.__name__}.{f.name} repeats a config default"
    # The router has no policy record of its own: the dispatcher holds the config's models.
    from splitserve.router import dispatch
    from splitserve.router.policy import LimitsSpec

    assert not hasattr(dispatch, "RoutingPolicy")
    assert config_mod.LimitsSpec is LimitsSpec and ClusterConfig().limits == LimitsSpec()


def test_missing_file():
    with pytest.raises(ValueError, match="cannot read config"):
        ClusterConfig.load("/nonexistent/cluster.yaml")


def test_a_tp_size_the_model_cannot_split_is_refused_before_any_worker_starts():
    from splitserve.cluster.app import check_model_fits_pools
    from splitserve.engine.model.config import ModelConfig
    from tests.conftest import tiny_hf_config

    model = ModelConfig.from_hf(tiny_hf_config("llama"))  # 4 heads, 2 KV heads
    for tp in (2, 4):  # 4: each KV head replicated on two ranks
        check_model_fits_pools(ClusterConfig.model_validate({"prefill": {"tp_size": tp}}), model)
    with pytest.raises(
        ValueError, match=r"prefill.tp_size does not fit .* attention heads \(4\) to divide by 3"
    ):
        check_model_fits_pools(ClusterConfig.model_validate({"prefill": {"tp_size": 3}}), model)
    model = dataclasses.replace(model, num_heads=12, num_kv_heads=3)  # 3 KV heads over 4 ranks
    with pytest.raises(ValueError, match=r"KV heads \(3\) to divide by 4 \(split\) or 4 to divide by them"):
        check_model_fits_pools(ClusterConfig.model_validate({"prefill": {"tp_size": 4}}), model)


def test_max_tokens_and_lease_defaults_are_written_once():
    """``DEFAULT_MAX_TOKENS`` (wire/sampling.py) and ``DEFAULT_LEASE_S``
    (wire/kv.py) are the only literals of those defaults in the code."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    homes = {"wire/sampling.py", "wire/kv.py"}
    pattern = re.compile(
        r"(max_tokens\w*\s*(:[^=]*)?=\s*16\b)|(lease\w*\s*(:[^=]*)?=\s*(Field\()?30(\.0)?\b)", re.I
    )
    found = []
    for path in root.glob("*/**/*.py"):
        rel = str(path.relative_to(root))
        if rel.startswith(("tests/", ".venv/")) or "/." in rel or rel in homes:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert found == [], found
    for home, name in (
        ("wire/sampling.py", "DEFAULT_MAX_TOKENS"),
        ("wire/kv.py", "DEFAULT_LEASE_S"),
    ):
        assert re.search(rf"^{name} = ", (root / home).read_text(), re.M), home  # the home says it


def test_the_openai_endpoint_may_ignore_unknown_fields():
    assert not ClusterConfig().router.openai.ignore_unknown_fields  # strict unless asked
    on = ClusterConfig.model_validate({"router": {"openai": {"ignore_unknown_fields": True}}})
    assert on.router.openai.ignore_unknown_fields
    with pytest.raises(ValueError, match="ignore_unknown_field"):
        ClusterConfig.model_validate({"router": {"openai": {"ignore_unknown_field": True}}})


def test_kv_relief_is_on_by_default_and_its_thresholds_are_ordered():
    relief = ClusterConfig().router.kv_relief.relief()
    assert relief.below < relief.above <= 1
    assert ClusterConfig.model_validate({"router": {"kv_relief": None}}).router.kv_relief is None
    with pytest.raises(ValueError, match="would move back and forth"):
        ClusterConfig.model_validate({"router": {"kv_relief": {"above": 0.8, "below": 0.8}}})


def test_the_stall_budget_keeps_the_tpot_target_the_router_knows():
    from splitserve.cluster.router_parts import routing_policy

    assert routing_policy(ClusterConfig()).stall_tpot_ms is None  # no target: counted in steps
    slo = {"autoscaling": {"policy": "slo", "min_replicas": 1, "max_replicas": 2}}
    planned = {"prefill": slo, "decode": slo, "planner": {"ttft_ms": 500, "tpot_ms": 40}}
    assert routing_policy(ClusterConfig.model_validate(planned)).stall_tpot_ms == 40  # the SLO's
    admitted = ClusterConfig.model_validate({"limits": {"decode_tpot_ms": 60}})
    assert routing_policy(admitted).stall_tpot_ms == 60  # admission's, with no planner
    own = ClusterConfig.model_validate({**planned, "policy": {"stall_tpot_ms": 25}})
    assert routing_policy(own).stall_tpot_ms == 25  # the policy's own wins


def test_elastic_mode_needs_the_planner_and_one_kind_of_worker_in_both_roles():
    slo = {"autoscaling": {"policy": "slo", "min_replicas": 1, "max_replicas": 3}}
    planner = {"ttft_ms": 500, "tpot_ms": 50}
    ok = ClusterConfig.model_validate(
        {"mode": "elastic", "prefill": slo, "decode": {**slo, "replicas": 2}, "planner": planner}
    )
    assert ok.elastic_workers == 3 and set(ok.pools()) == {"prefill", "decode"}
    with pytest.raises(ValueError, match="set autoscaling.policy slo"):
        ClusterConfig.model_validate({"mode": "elastic"})
    with pytest.raises(ValueError, match="engine, device, num_cpus"):
        ClusterConfig.model_validate(
            {"mode": "elastic", "prefill": slo, "decode": {**slo, "num_cpus": 2}, "planner": planner}
        )
    with pytest.raises(ValueError, match="tp_size and ep_size 1"):
        ClusterConfig.model_validate(
            {
                "mode": "elastic",
                "prefill": {**slo, "tp_size": 2},
                "decode": {**slo, "tp_size": 2},
                "planner": planner,
            }
        )


def test_only_the_prefill_role_of_an_elastic_cluster_may_shrink_to_none():
    slo = {"autoscaling": {"policy": "slo", "min_replicas": 1, "max_replicas": 2}}
    none = {"autoscaling": {"policy": "slo", "min_replicas": 0, "max_replicas": 2}}
    planner = {"ttft_ms": 500, "tpot_ms": 50}
    ok = ClusterConfig.model_validate({"mode": "elastic", "prefill": none, "decode": slo, "planner": planner})
    assert ok.prefill.autoscaling.min_replicas == 0
    for mode, prefill, decode in [("elastic", slo, none), ("disaggregated", none, slo)]:
        with pytest.raises(ValueError, match="only the prefill role of an elastic cluster"):
            ClusterConfig.model_validate(
                {"mode": mode, "prefill": prefill, "decode": decode, "planner": planner}
            )
