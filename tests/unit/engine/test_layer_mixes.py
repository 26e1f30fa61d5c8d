"""Models whose layers differ, beyond the one mix each family's tiny checkpoint has
(``tests.conftest.tiny_hf_config``): other seeds, other orders of sliding and full
layers, other windows, prompts past them. Float32 greedy tokens equal transformers'
``generate`` on the native CPU path, with chunked prefill and prefix caching."""

from __future__ import annotations

import pytest

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

SLIDING, FULL = "sliding_attention", "full_attention"
MIXES = [
    ("gpt_oss", 1, {"layer_types": [FULL, SLIDING, SLIDING, FULL], "sliding_window": 8}),
    ("gpt_oss", 2, {"layer_types": [SLIDING] * 4, "sliding_window": 24}),
    ("gemma3_text", 1, {"layer_types": [SLIDING] * 5 + [FULL], "sliding_window": 12}),
    ("gemma3_text", 2, {"layer_types": [FULL] + [SLIDING] * 5, "sliding_window": 5}),
    # a Gemma 3 config that names an attention soft cap: transformers' Gemma 3 never applies
    # it, nor does the engine (the tokens differ where it is applied: checked by hand)
    ("gemma3_text", 3, {"sliding_window": 10, "attn_logit_softcapping": 3.0}),
    ("gemma2", 2, {"layer_types": [SLIDING] * 3 + [FULL], "sliding_window": 7}),
]


def _id(kind: str, seed: int, mix: dict) -> str:
    cap = mix.get("attn_logit_softcapping")
    return f"{kind}-seed{seed}-w{mix['sliding_window']}" + (f"-cap{cap:g}" if cap else "")


@pytest.mark.parametrize("kind, seed, mix", MIXES, ids=[_id(*m) for m in MIXES])
def test_other_layer_mixes_equal_transformers(tmp_path, kind, seed, mix):
    hf = make_hf_checkpoint(kind, tmp_path, seed=seed, **mix)
    prompts = random_prompts([6, 30, 75], 512, seed=seed)
    prompts += random_prompts([50], 512, seed=seed, shared_prefix=30)
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    config = EngineConfig(
        model=str(tmp_path), dtype="float32", block_size=8, max_num_batched_tokens=32, kv_cache_memory_mib=16
    )
    engine = Engine(config)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected  # from the prefix cache
