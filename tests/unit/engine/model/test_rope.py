"""RoPE scaling variants against transformers' own definitions."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.rope import rope_inv_freq
from splitserve.wire.errors import ModelLoadError
from tests.conftest import tiny_hf_config

VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_inv_freq_matches_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_theta=50000.0,
        rope_scaling=VARIANTS[name],
    )
    cfg = ModelConfig.from_hf(hf)
    ours, scaling = rope_inv_freq(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
    if name == "default":
        ref = 1.0 / (50000.0 ** (torch.arange(0, 64, 2).float() / 64))
        ref_scaling = 1.0
    else:
        ref, ref_scaling = ROPE_INIT_FUNCTIONS[name](hf, "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(ref_scaling)


def test_unsupported_rope_type_is_refused():
    hf = tiny_hf_config("llama")
    hf.rope_parameters = {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ModelLoadError):
        rope_inv_freq(16, ModelConfig.from_hf(hf).rope, 1024)
