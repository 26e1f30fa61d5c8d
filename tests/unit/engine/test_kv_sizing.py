"""The KV cache's size and the context it allows (engine.kv_sizing), as vLLM sizes them."""

from __future__ import annotations

import pytest

from splitserve.engine import kv_sizing
from splitserve.engine.engine import Engine
from splitserve.engine.kv_sizing import kv_budget_bytes
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import InvalidRequest
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, tiny_hf_config

GIB = 2**30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_hf_checkpoint("llama", directory)  # max_position_embeddings 1024
    return str(directory)


def test_the_budget_is_the_size_given_else_a_share_of_free_gpu_memory_else_the_cpu_default():
    assert kv_budget_bytes(EngineConfig(kv_cache_memory_mib=64), "cuda", 40 * GIB) == 64 * 2**20
    frac = EngineConfig(kv_cache_memory_fraction=0.5)
    assert kv_budget_bytes(frac, "cuda", 40 * GIB) == 20 * GIB
    # read at call time: the suite lowers the default (tests/conftest.py)
    assert kv_budget_bytes(frac, "cpu", None) == kv_sizing.DEFAULT_CPU_KV_CACHE_MIB * 2**20
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
            EngineConfig(kv_cache_memory_fraction=bad)


def test_the_cache_is_sized_from_its_budget_and_the_model_per_token(checkpoint):
    cfg = tiny_hf_config("llama")
    per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", kv_cache_memory_mib=1))
    c = engine.capacity
    assert c.bytes_per_token == per_token
    assert c.num_tokens == 2**20 // (per_token * 16) * 16 == engine.block_manager.num_blocks * 16
    assert c.max_model_len == min(1024, c.num_tokens) == engine.validator.max_model_len
    assert c.max_concurrency == pytest.approx(c.num_tokens / c.max_model_len)
    assert f"max context {c.max_model_len:,} tokens" in engine.summary


def test_a_model_context_longer_than_the_cache_is_lowered_to_it_and_one_request_can_fill_it(checkpoint):
    engine = Engine(EngineConfig(model=checkpoint, dtype="float32", block_size=8, num_kv_blocks=4))
    assert engine.max_model_len == engine.capacity.max_model_len == 32  # not the model's 1024
    assert engine.capacity.max_concurrency == 1.0
    with pytest.raises(InvalidRequest, match="lower max_tokens to at most 22"):
        engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=23, ignore_eos=True))
    (out,) = engine.generate([list(range(1, 11))], SamplingParams(max_tokens=22, ignore_eos=True))
    assert len(out.token_ids) == 22 and out.finish_reason.value == "length"


def test_a_max_model_len_the_cache_cannot_hold_fails_at_start_naming_both_ways_out(checkpoint):
    with pytest.raises(ValueError, match="lower max_model_len to at most 32") as e:
        Engine(
            EngineConfig(model=checkpoint, dtype="float32", block_size=8, num_kv_blocks=4, max_model_len=64)
        )
    assert "kv_cache_memory_mib" in str(e.value)
    ok = Engine(
        EngineConfig(model=checkpoint, dtype="float32", block_size=8, num_kv_blocks=4, max_model_len=24)
    )
    assert (ok.max_model_len, ok.capacity.max_concurrency) == (24, 32 / 24)


def test_a_max_model_len_beyond_the_models_context_is_refused(checkpoint):
    with pytest.raises(ValueError, match="longer than the model's context"):
        Engine(EngineConfig(model=checkpoint, dtype="float32", max_model_len=4096))
