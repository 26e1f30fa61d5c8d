"""Gemma 3's final logit soft-capping (``cap * tanh(logits / cap)``) shows in the
log-probabilities, not in greedy tokens (tanh keeps the order): each chosen
token's logprob and the top five's equal transformers' log-softmax of its
soft-capped logits, step by step. (Greedy equality with sliding windows, both
RoPEs and the norms is ``test_correctness``'s.)"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, random_prompts


def test_logprobs_equal_transformers_soft_capped(tmp_path):
    hf = make_hf_checkpoint("gemma3_text", tmp_path)
    assert hf.config.final_logit_softcapping is not None
    prompt = random_prompts([40], 512, seed=5)[0]  # past the 16-token window
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_memory_mib=8))
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5)
    (out,) = engine.generate([prompt], params)
    ids = list(prompt)
    with torch.no_grad():
        for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            best = ref.topk(5)
            assert token == int(best.indices[0])  # greedy
            assert logprob == pytest.approx(ref[token].item(), abs=1e-4)
            assert [t for t, _ in top] == best.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(best.values.tolist(), abs=1e-4)
            ids.append(token)
