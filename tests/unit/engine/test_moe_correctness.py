"""Mixture-of-experts and MLA models in one engine: float32 greedy output equals
transformers' ``generate``, token for token.

Random-weight tiny Mixtral, Qwen2-MoE (gated shared expert), Qwen3-MoE (a dense
first layer), DeepSeek-V3 (MLA with a q bottleneck; sigmoid routing in groups
with a correction bias, a shared expert, a dense first layer), gpt-oss
(sliding-window layers of 16 tokens beside full ones, attention sinks, biases
everywhere, YaRN, the clamped SwiGLU; transformers' stacked-expert layout) and
GLM-4.5 (DeepSeek-V3's routing over GQA with q/k norms, RoPE over half of each
head) and DeepSeek-V3.2 (V3 with the sparse attention's indexer keeping 8 tokens a
query: every prompt and output here grows past it) checkpoints
(``tests.conftest.tiny_hf_config``); 6 prompts, several longer than the 32-token
prefill chunk and two sharing a prefix; prefix caching (the second pass hits the
cache) and a cache too small for the batch (preemption).
"""

from __future__ import annotations

import pytest

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

MAX_NEW = 16
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v32", "gpt_oss", "glm4_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, directory)
    prompts = random_prompts([3, 17, 47, 90], 512) + random_prompts([60, 71], 512, seed=2, shared_prefix=40)
    return directory, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def make_engine(directory, **overrides) -> Engine:
    cfg = dict(
        model=str(directory),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        kv_cache_memory_mib=32,  # below the suite's 128 MiB default: many live at once here
    )
    return Engine(EngineConfig(**(cfg | overrides)))


def test_moe_and_mla_greedy_equal_transformers_with_prefix_hits(reference):
    directory, prompts, expected = reference
    engine = make_engine(directory, enable_prefix_caching=True)
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    again = engine.generate(prompts, PARAMS)  # every prompt's full blocks are cached now
    assert [o.token_ids for o in again] == expected
    assert all(o.num_cached_tokens >= (len(p) - 1) // 8 * 8 for o, p in zip(again, prompts))
    assert engine.block_manager.num_used_blocks == 0


def test_moe_and_mla_greedy_equal_transformers_under_preemption(reference):
    directory, prompts, expected = reference
    # 24 blocks of 8 = 192 tokens: less than the batch needs (~380), more than any one sequence
    engine = make_engine(directory, num_kv_blocks=24, enable_prefix_caching=False)
    assert [o.token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert engine.scheduler.num_preemptions > 0
