"""The streaming, sharded loader: which files it reads, which slices each
tensor-parallel rank reads, where they land, and the errors it gives.

Shards are checked against the transformers model's own state dict, sliced here
by the Megatron rules (independently of the loader's placement code); ranks are
built in-process with ``TPGroup(rank, size)`` (loading runs no collectives)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from splitserve.engine.engine import Engine
from splitserve.engine.model.checkpoint import checkpoint_files, in_memory_tensors, safetensors_tensors
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import load_model
from splitserve.engine.parallel.group import TPGroup
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import ModelLoadError
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts, tiny_hf_config


def _build(directory_or_pairs, kind: str, tp: TPGroup, vocab_size: int = 512):
    cfg = ModelConfig.from_hf(tiny_hf_config(kind, vocab_size=vocab_size))
    if isinstance(directory_or_pairs, list):
        weights = in_memory_tensors(directory_or_pairs)
    else:
        weights = safetensors_tensors(directory_or_pairs)
    return load_model(cfg, torch.float32, torch.device("cpu"), 64, weights, tp=tp)


def _rows(t, rank, size):
    per = t.shape[0] // size
    return t[rank * per : (rank + 1) * per]


def _cols(t, rank, size):
    per = t.shape[1] // size
    return t[:, rank * per : (rank + 1) * per]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_each_rank_holds_exactly_its_megatron_shard(kind):
    hf = make_hf_checkpoint_in_memory(kind, vocab_size=509)  # 509: the vocabulary does not split evenly
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    size = 2
    for rank in range(size):
        model = _build(list(sd.items()), kind, TPGroup(rank, size), vocab_size=509)
        layer, ref = model.layers[1], "model.layers.1."
        want_qkv = torch.cat(
            [_rows(sd[ref + f"self_attn.{p}_proj.weight"], rank, size) for p in ("q", "k", "v")]
        )
        assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
        if kind == "qwen2":
            want_bias = torch.cat([_rows(sd[ref + f"self_attn.{p}_proj.bias"], rank, size) for p in "qkv"])
            assert torch.equal(layer.self_attn.qkv_proj.bias, want_bias)
        if kind == "qwen3":
            assert torch.equal(layer.self_attn.k_norm.weight, sd[ref + "self_attn.k_norm.weight"])
        assert torch.equal(
            layer.self_attn.o_proj.linear.weight, _cols(sd[ref + "self_attn.o_proj.weight"], rank, size)
        )
        gate, up = sd[ref + "mlp.gate_proj.weight"], sd[ref + "mlp.up_proj.weight"]
        want_gu = torch.cat([_rows(gate, rank, size), _rows(up, rank, size)])
        assert torch.equal(layer.mlp.gate_up_proj.weight, want_gu)
        assert torch.equal(
            layer.mlp.down_proj.linear.weight, _cols(sd[ref + "mlp.down_proj.weight"], rank, size)
        )
        embed = model.embed_tokens.weight  # 255 rows each; rank 1 holds 254 and one zero row
        full = sd["model.embed_tokens.weight"]
        assert embed.shape[0] == 255
        got = full[rank * 255 : min((rank + 1) * 255, 509)]
        assert torch.equal(embed[: got.shape[0]], got)
        assert not embed[got.shape[0] :].any()
        if kind == "llama":  # untied: its own rows; tied: the embedding itself
            assert torch.equal(
                model.lm_head.linear.weight[: got.shape[0]], sd["lm_head.weight"][rank * 255 :][:255]
            )
        else:
            assert model.lm_head.linear.weight is model.embed_tokens.weight


def make_hf_checkpoint_in_memory(kind: str, vocab_size: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_hf_config(kind, vocab_size=vocab_size)).eval()


class _Recording:
    """A tensor source that records the ranges read from it."""

    def __init__(self, tensor, log):
        self.tensor, self.log = tensor, log
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def read(self, dim=None, start=0, stop=None):
        idx = [slice(None)] * self.tensor.dim()
        if dim is not None:
            idx[dim] = slice(start, stop)
        out = self.tensor[tuple(idx)]
        self.log.append((out.numel(), self.tensor.numel(), self.tensor.dim()))
        return out


def test_a_rank_reads_only_its_slice_of_every_sharded_tensor():
    hf = make_hf_checkpoint_in_memory("llama", vocab_size=512)
    cfg = ModelConfig.from_hf(tiny_hf_config("llama"))
    log: list[tuple[int, int, int]] = []
    pairs = [(k, _Recording(v.detach(), log)) for k, v in hf.state_dict().items()]
    load_model(cfg, torch.float32, torch.device("cpu"), 64, pairs, tp=TPGroup(1, 2))
    matrices = [(read, full) for read, full, ndim in log if ndim == 2]
    assert len(matrices) == 2 * 7 + 2  # 7 per layer, embedding and LM head
    assert all(read * 2 == full for read, full in matrices)


def test_random_weights_are_the_same_model_at_every_tp_size():
    cfg = ModelConfig.from_hf(tiny_hf_config("llama"))
    whole = load_model(cfg, torch.float32, torch.device("cpu"), 64, None, seed=3)
    half = load_model(cfg, torch.float32, torch.device("cpu"), 64, None, seed=3, tp=TPGroup(1, 2))
    assert torch.equal(
        half.layers[0].mlp.down_proj.linear.weight, _cols(whole.layers[0].mlp.down_proj.linear.weight, 1, 2)
    )
    other = load_model(cfg, torch.float32, torch.device("cpu"), 64, None, seed=4)
    assert not torch.equal(
        other.layers[0].mlp.down_proj.linear.weight, whole.layers[0].mlp.down_proj.linear.weight
    )


def test_a_sharded_directory_loads_through_its_index_and_skips_consolidated(tmp_path):
    hf = make_hf_checkpoint("llama", tmp_path)
    hf.save_pretrained(str(tmp_path), max_shard_size="100KB")  # several files and an index
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # Mistral ships consolidated.safetensors (its own naming) beside the HF shards
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(tmp_path / "consolidated.safetensors"))
    assert all(f.name != "consolidated.safetensors" for f in checkpoint_files(tmp_path))
    prompts = random_prompts([5, 19], 512)
    engine = Engine(
        EngineConfig(model=str(tmp_path), dtype="float32", native_kernels=False, attention_backend="sdpa")
    )
    out = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in out] == [hf_greedy(hf, p, 8) for p in prompts]


def test_consolidated_beside_shards_without_an_index_is_skipped(tmp_path):
    for name in (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "consolidated.safetensors",
    ):
        save_file({"x": torch.zeros(1)}, str(tmp_path / name))
    assert [f.name for f in checkpoint_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_a_pickle_only_directory_gets_a_clear_error(tmp_path):
    tiny_hf_config("llama").save_pretrained(str(tmp_path))
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only PyTorch pickle weights.*pytorch_model.bin.*safetensors"):
        Engine(EngineConfig(model=str(tmp_path), dtype="float32"))


def test_wrong_shapes_and_missing_tensors_are_named():
    hf = make_hf_checkpoint_in_memory("llama", vocab_size=512)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    bad = dict(sd, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)})
    with pytest.raises(ModelLoadError, match=r"up_proj.weight has shape \(3, 64\), expected \(128, 64\)"):
        _build(list(bad.items()), "llama", TPGroup.single())
    partial = {k: v for k, v in sd.items() if "layers.1.self_attn.v_proj" not in k}
    with pytest.raises(ModelLoadError, match="missing 1 tensors.*layers.1.self_attn.qkv_proj"):
        _build(list(partial.items()), "llama", TPGroup.single())
    extra = dict(sd, **{"model.layers.0.mlp.experts.0.weight": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match="experts.0.weight has no place"):
        _build(list(extra.items()), "llama", TPGroup.single())
