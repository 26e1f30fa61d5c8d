"""``splitserve serve MODEL`` with vLLM's flags: each flag given overrides the
config file, each left out keeps it, and a bad value is refused before Ray starts."""

from __future__ import annotations

import pytest

from splitserve.cli.main import build_parser, serve_config
from splitserve.cluster.config import ClusterConfig


def _config(*argv: str, base: ClusterConfig | None = None) -> ClusterConfig:
    args = build_parser().parse_args(["serve", *argv])
    return serve_config(args, base or ClusterConfig.load())


def test_no_flags_leave_the_config_as_it_is():
    assert _config() == ClusterConfig.load()


def test_vllm_flags_override_the_config():
    cfg = _config(
        "/models/llama",
        "--tensor-parallel-size", "2",
        "--max-model-len", "4096",
        "--dtype", "bfloat16",
        "--quantization", "fp8",
        "--host", "0.0.0.0",
        "--port", "6000",
        "--generation-config", "vllm",
        "--kv-cache-memory-fraction", "0.7",
    )  # fmt: skip
    assert cfg.model.name == "/models/llama"
    assert cfg.model.public_name == "/models/llama"  # the name as the user gave it, as vLLM serves it
    assert (cfg.model.max_model_len, cfg.model.dtype, cfg.model.generation_config) == (
        4096,
        "bfloat16",
        False,
    )
    assert cfg.prefill.tp_size == cfg.decode.tp_size == cfg.colocated.tp_size == 2
    assert cfg.prefill.engine.quantization == cfg.decode.engine.quantization == "fp8"
    assert cfg.prefill.engine.kv_cache_memory_fraction == cfg.decode.engine.kv_cache_memory_fraction == 0.7
    assert cfg.engine_config("decode").kv_cache_memory_fraction == 0.7
    assert (cfg.router.host, cfg.router.port, cfg.router.http_port) == ("0.0.0.0", 6000, 8000)


def test_served_model_name_wins_and_bad_values_are_refused():
    assert _config("/models/llama", "--served-model-name", "llama").model.public_name == "llama"
    with pytest.raises(ValueError, match="max_model_len"):
        _config("--max-model-len", "1")
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        _config("--kv-cache-memory-fraction", "1.5")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "int4"])


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--tensor-parallel-size",
        "--max-model-len",
        "--dtype",
        "--quantization",
        "--served-model-name",
        "--host",
        "--port",
        "--generation-config",
    ):
        assert flag in out


def test_expert_parallel_size_sets_decode_and_colocated_pools_only():
    cfg = _config("--expert-parallel-size", "2")
    assert (cfg.prefill.ep_size, cfg.decode.ep_size, cfg.colocated.ep_size) == (1, 2, 2)
    assert cfg.engine_config("decode").ep_size == 2 and cfg.decode.ranks == 2
    with pytest.raises(ValueError, match="tp_size must be 1"):
        _config("--expert-parallel-size", "2", "--tensor-parallel-size", "2")
    with pytest.raises(ValueError, match="prefill.ep_size must be 1"):
        ClusterConfig.model_validate(ClusterConfig.load().model_dump() | {"prefill": {"ep_size": 2}})


def test_router_replicas_flag_sets_the_count_and_a_bad_one_is_refused():
    assert _config("--router-replicas", "3").router.replicas == 3
    with pytest.raises(ValueError, match="replicas"):
        _config("--router-replicas", "0")


def test_vllm_lora_flags_give_every_worker_the_adapters():
    chat = '{"name": "chat", "path": "/adapters/chat", "base_model_name": "/models/llama"}'
    cfg = _config(
        "/models/llama",
        "--lora-modules", "sql=/adapters/sql", chat,
        "--max-loras", "2",
        "--max-cpu-loras", "3",
        "--max-lora-rank", "32",
    )  # fmt: skip
    assert cfg.model.enable_lora  # --lora-modules implies it, as in vLLM
    assert cfg.model.lora_modules == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    for role in ("prefill", "decode"):
        engine = cfg.engine_config(role)
        lora = (
            engine.enable_lora,
            engine.lora_modules,
            engine.max_loras,
            engine.max_cpu_loras,
            engine.max_lora_rank,
        )
        assert lora == (True, {"sql": "/adapters/sql", "chat": "/adapters/chat"}, 2, 3, 32)
    with pytest.raises(ValueError, match="give NAME=PATH"):
        _config("--lora-modules", "sql")
    with pytest.raises(ValueError, match="is for 'other'"):
        _config("/models/llama", "--lora-modules", '{"name": "a", "path": "/a", "base_model_name": "other"}')
    more = _config("--lora-modules", "a=/a", "b=/b", "--max-loras", "1").engine_config("decode")
    assert more.num_lora_slots == 1  # more adapters than slots: they take turns
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        _config("--lora-modules", "a=/a", "--max-loras", "2", "--max-cpu-loras", "1").engine_config("decode")
