"""The serving config: defaults, the shipped YAMLs, and clear errors."""

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
        ("decode: {tp_size: 2}\n", "only prefill workers run tensor-parallel"),
        ("mode: colocated\ncolocated: {tp_size: 2}\n", "only prefill workers run tensor-parallel"),
        ("decode: {engine: {quantization: int4}}\n", "quantization"),
        ("decode: {engine: {cuda_graphs: true}}\n", "needs engine.attention_backend: triton"),
        ("router: {tls_cert: a.pem}\n", "tls_key"),
        ("limits: {max_inflight_requests: 0}\n", "max_inflight_requests"),
        ("modle: {name: x}\n", "modle"),
        ("model: [unclosed\n", "not valid YAML"),
    ],
)
def test_invalid_configs_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        ClusterConfig.load(path)


def test_quantization_is_chosen_per_pool(tmp_path):
    from splitserve.cluster.pools import engine_config

    path = tmp_path / "q.yaml"
    path.write_text("prefill: {engine: {quantization: fp8}}\ndecode: {engine: {quantization: int8}}\n")
    config = ClusterConfig.load(path)
    assert engine_config(config, config.prefill).quantization == "fp8"
    assert engine_config(config, config.decode).quantization == "int8"
    assert engine_config(ClusterConfig(), ClusterConfig().colocated).quantization == "none"


def test_missing_file():
    with pytest.raises(ValueError, match="cannot read config"):
        ClusterConfig.load("/nonexistent/cluster.yaml")


def test_a_tp_size_the_model_cannot_split_is_refused_before_any_worker_starts():
    from splitserve.cluster.app import check_model_fits_pools
    from splitserve.engine.model.config import ModelConfig
    from tests.conftest import tiny_hf_config

    model = ModelConfig.from_hf(tiny_hf_config("llama"))  # 4 heads, 2 KV heads
    check_model_fits_pools(ClusterConfig.model_validate({"prefill": {"tp_size": 2}}), model)
    with pytest.raises(ValueError, match=r"prefill.tp_size does not fit .* KV heads \(2\) to divide by 4"):
        check_model_fits_pools(ClusterConfig.model_validate({"prefill": {"tp_size": 4}}), model)
