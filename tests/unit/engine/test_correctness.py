"""Greedy output of the engine equals transformers' generate, token for token.

Random-weight tiny Llama / Qwen2 / Qwen3 / Gemma 3 (sliding-window layers of 16
tokens, a RoPE per layer kind, sandwich norms) checkpoints, 10 prompts of different
lengths (several longer than the 32-token prefill chunk, several sharing a
prefix), float32, under three cache regimes: prefix caching on (a second pass
must hit the cache), off, and a cache too small for the batch (preemption).
"""

from __future__ import annotations

import pytest

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

LENGTHS = [3, 9, 17, 33, 47, 64, 90, 130, 5, 71]
MAX_NEW = 24
CHUNK = 32


@pytest.fixture(scope="module", params=["portable", "native"])
def backend(request):
    """portable: pure torch (SDPA attention, torch norms); native: the C++ CPU kernels."""
    return request.param


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "qwen3", "gemma2", "gemma3_text"])
def reference(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, directory)
    prompts = random_prompts(LENGTHS[:6], 512) + random_prompts(LENGTHS[6:], 512, seed=2, shared_prefix=40)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return directory, prompts, expected


def make_engine(directory, backend, **overrides) -> Engine:
    cfg = dict(
        attention_backend="sdpa" if backend == "portable" else "cpu",
        native_kernels=backend == "native",
        model=str(directory),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=16,
        kv_cache_memory_mib=32,  # below the suite's 128 MiB default: dozens live at once here
    )
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def test_matches_hf_with_prefix_caching(reference, backend):
    directory, prompts, expected = reference
    engine = make_engine(directory, backend, enable_prefix_caching=True)
    first = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in first] == expected
    second = engine.generate(prompts, PARAMS)  # every prompt's full blocks are cached now
    assert [o.token_ids for o in second] == expected
    assert all(o.num_cached_tokens >= (len(p) - 1) // 8 * 8 for o, p in zip(second, prompts))
    assert sum(o.num_cached_tokens for o in second) > 0
    assert engine.block_manager.num_used_blocks == 0


def test_matches_hf_without_prefix_caching(reference, backend):
    directory, prompts, expected = reference
    engine = make_engine(directory, backend, enable_prefix_caching=False)
    out = engine.generate(prompts, PARAMS)
    assert [o.token_ids for o in out] == expected
    assert all(o.num_cached_tokens == 0 for o in out)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_matches_hf_under_preemption(reference, backend, prefix_caching):
    directory, prompts, expected = reference
    # 40 blocks of 8 = 320 tokens: far less than the batch needs (~800), more than any one sequence.
    engine = make_engine(directory, backend, num_kv_blocks=40, enable_prefix_caching=prefix_caching)
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    states = {i: engine.requests[i] for i in ids}
    preempted = 0
    while engine.has_unfinished():
        preempted += len(engine.scheduler.running)
        engine.step()
    preemptions = sum(s.seq.num_preemptions for s in states.values())
    assert preemptions > 0
    assert [states[i].seq.output_token_ids for i in ids] == expected
    assert engine.block_manager.num_used_blocks == 0


def test_penalties_and_bias_match_hf_in_a_mixed_batch(tmp_path):
    """Greedy with ``repetition_penalty`` and ``logit_bias`` equals transformers'
    ``generate(repetition_penalty=, sequence_bias=)``, batched with plain greedy rows
    and with prompts long enough to be prefilled in chunks."""
    import torch

    hf = make_hf_checkpoint("llama", tmp_path)
    prompts = random_prompts([5, 40, 70, 12], 512, seed=4)
    engine = make_engine(tmp_path, "native")
    penalized = SamplingParams(
        max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.8, logit_bias={7: 4.0}
    )
    params = [penalized, PARAMS, penalized, PARAMS]
    got = [c.token_ids for c in engine.generate(prompts, params)]
    for prompt, p, out in zip(prompts, params, got):
        extra = {}
        if p is penalized:
            extra = dict(repetition_penalty=1.8, sequence_bias={(7,): 4.0})
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0, **extra,
            )  # fmt: skip
        assert out == ref[0, len(prompt) :].tolist()
    assert got[0] != [c.token_ids for c in engine.generate(prompts[:1], [PARAMS])][0]  # it changed something
