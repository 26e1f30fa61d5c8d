"""gpt-oss checkpoints as released: MXFP4 expert stacks (blocks and scales) load,
dequantised as they are read, and the engine's greedy tokens equal transformers'
on the stacks as transformers dequantises them. Checkpoints that cannot run are
refused at load with a sentence naming what is wrong: a missing sinks tensor, a
window larger than the context, a layer type splitserve does not run, MXFP4 blocks
without their scales. (The bf16 layout equals transformers in
``test_moe_correctness``.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.bench.tiny_models import make_mxfp4_gpt_oss
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import ModelLoadError
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

STACK = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt-oss")
    make_hf_checkpoint("gpt_oss", directory)
    return directory


def _spoiled(good, tmp_path, case: str):
    shutil.copy(good / "config.json", tmp_path)
    tensors = load_file(good / "model.safetensors")
    config = json.loads((good / "config.json").read_text())
    if case == "missing sinks":
        del tensors["model.layers.1.self_attn.sinks"]
    elif case == "window past the context":
        config["sliding_window"] = config["max_position_embeddings"] + 1
    elif case == "unknown layer type":
        config["layer_types"][2] = "chunked_attention"
    elif case == "mxfp4 blocks without scales":
        tensors[STACK + "_blocks"] = tensors.pop(STACK).to(torch.uint8)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "case, sentence",
    [
        ("missing sinks", r"missing 1 tensors, e\.g\. \['layers\.1\.self_attn\.sinks'\]"),
        ("window past the context", r"config\.json: sliding_window 1025 is not a window within the context"),
        ("unknown layer type", r"layer_types has 'chunked_attention', which splitserve does not run"),
        ("mxfp4 blocks without scales", rf"checkpoint tensor {STACK}_blocks has no {STACK}_scales"),
    ],
)
def test_a_bad_checkpoint_is_refused_at_load_naming_what_is_wrong(good, tmp_path, case, sentence):
    Engine(EngineConfig(model=str(good), dtype="float32", kv_cache_memory_mib=4))  # the good one loads
    spoiled = _spoiled(good, tmp_path, case)
    with pytest.raises(ModelLoadError, match=sentence):
        Engine(EngineConfig(model=str(spoiled), dtype="float32", kv_cache_memory_mib=4))


def test_mxfp4_experts_load_and_equal_transformers_dequantised(tmp_path):
    reference = make_mxfp4_gpt_oss(tmp_path)
    prompts = random_prompts([3, 17, 47, 90], 512)  # past the 16-token window
    expected = [hf_greedy(reference, p, 12) for p in prompts]
    config = EngineConfig(
        model=str(tmp_path), dtype="float32", block_size=8, max_num_batched_tokens=32, kv_cache_memory_mib=16
    )
    engine = Engine(config)
    out = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in out] == expected
