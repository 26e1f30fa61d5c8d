"""The engine on CUDA equals transformers' generate (float32; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def triton_config(model: str, cuda_graphs: bool = True, **extra) -> EngineConfig:
    """A float32 CUDA engine on the Triton backend (decode graphs unless told not)."""
    return EngineConfig(
        model=model,
        dtype="float32",
        device="cuda",
        attention_backend="triton",
        cuda_graphs=cuda_graphs,
        max_num_seqs=8,
        max_model_len=512,
        num_kv_blocks=128,
        **extra,
    )


def test_cuda_engine_matches_hf(tmp_path):
    hf = make_hf_checkpoint("llama", tmp_path)
    prompts = random_prompts([5, 40, 77, 130], 512)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    engine = Engine(
        EngineConfig(
            model=str(tmp_path), dtype="float32", device="cuda", block_size=16, max_num_batched_tokens=64
        )
    )
    out = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in out] == expected


def test_cuda_engine_with_triton_attention_and_decode_graphs_matches_hf(tmp_path):
    hf = make_hf_checkpoint("llama", tmp_path)
    prompts = random_prompts([5, 40, 77, 130, 9], 512)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    engine = Engine(triton_config(str(tmp_path)))
    out = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in out] == expected


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_moe_and_mla_on_cuda_match_hf(tmp_path, kind):
    """The MoE families on CUDA, the routed experts through the Triton grouped GEMMs
    (``kernels.triton_moe``) and MLA through its torch attention."""
    hf = make_hf_checkpoint(kind, tmp_path)
    prompts = random_prompts([5, 40, 77, 130], 512)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    engine = Engine(
        EngineConfig(
            model=str(tmp_path),
            dtype="float32",
            device="cuda",
            block_size=16,
            max_num_batched_tokens=64,
            num_kv_blocks=256,
        )
    )
    assert all(m.grouped_kernel is not None for m in engine.model.moe_layers())
    out = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in out] == expected


def test_moe_decode_graphs_on_cuda_match_hf(tmp_path):
    """``cuda_graphs: true`` with MoE layers: decode steps replay captured graphs of the
    fused experts (``triton_moe.fused_experts``) and keep transformers' tokens (Mixtral;
    the Qwen3-MoE shape's step is replayed in ``test_gpu_paths``)."""
    from tests.unit.engine.attention.test_triton_decode import count_replays

    hf = make_hf_checkpoint("mixtral", tmp_path)
    prompts = random_prompts([5, 40, 77, 130, 9], 512)
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    engine = Engine(triton_config(str(tmp_path)))
    graphs = engine.runner.graphs
    assert graphs is not None
    replays = count_replays(graphs)
    out = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in out] == expected
    assert sum(replays.values()) > 0


def test_an_fp8_cache_on_cuda_reads_in_the_kernel_and_its_graphs_as_sdpa_does(tmp_path):
    """FP8 KV on CUDA: ``auto`` picks the Triton kernel, which reads e4m3 in place and
    is captured in CUDA graphs; the same tokens as the SDPA backend's dequantizing
    gathers on the same calibrated cache."""
    make_hf_checkpoint("llama", tmp_path)
    prompts = random_prompts([5, 40, 77, 130, 9], 512)
    outs = {}
    for name in ("sdpa", "auto"):
        engine = Engine(
            EngineConfig(
                model=str(tmp_path),
                dtype="float32",
                device="cuda",
                attention_backend=name,
                kv_cache_dtype="fp8",
                max_num_seqs=8,
                max_model_len=512,
                num_kv_blocks=128,
            )
        )
        chosen = (engine.runner.backend.name, engine.runner.graphs is not None)
        assert chosen == (("sdpa", False) if name == "sdpa" else ("triton", True))
        out = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        outs[name] = [o.token_ids for o in out]
    assert outs["auto"] == outs["sdpa"]


def test_verification_steps_replay_the_decode_graphs_and_keep_transformers_tokens(tmp_path):
    """With CUDA graphs, a draft's rows are packed as one-token decode spans
    (``ModelRunner.spread_drafts``), so steps with drafts replay the decode graphs:
    greedy tokens equal transformers', and graph replays with more rows than
    sequences happened (rows = sequences + their draft tokens)."""
    from tests.unit.engine.attention.test_triton_decode import speculating_with_graphs

    engine, tokens, expected, replayed = speculating_with_graphs(tmp_path, "cuda", 8, 512, 24)
    assert engine.runner.spread_drafts
    assert tokens == expected
    assert engine.stats().speculation.accepted_tokens > 0
    assert max(replayed) > 3, replayed  # a step with drafts replayed a graph (3 sequences)


def test_decode_graphs_with_lora_adapters_keep_the_eager_tokens(tmp_path):
    """Decode steps of base and adapter rows replayed from CUDA graphs (the adapters'
    one-hot pass over the graph's static buffer) give the tokens of the same engine run
    eagerly, whose LoRA path the CPU tests hold to transformers + PEFT."""
    from splitserve.bench.lora_bench import write_adapter

    make_hf_checkpoint("llama", tmp_path / "model")
    cpu = Engine(EngineConfig(model=str(tmp_path / "model"), dtype="float32", num_kv_blocks=8))
    modules = {}
    for i, name in enumerate(("a1", "a2")):
        write_adapter(tmp_path / name, cpu, rank=4 * (i + 1), seed=i, scale=0.3)  # it changes the tokens
        modules[name] = str(tmp_path / name)
    prompts = random_prompts([5, 40, 77, 130, 9, 21], 512)
    which = [None, "a1", "a2", "a1", None, "a2"]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, adapter=a) for a in which]
    tokens = {}
    for graphs in (False, True):
        lora = dict(enable_lora=True, lora_modules=modules, max_lora_rank=8)
        engine = Engine(triton_config(str(tmp_path / "model"), cuda_graphs=graphs, **lora))
        tokens[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
    assert tokens[True] == tokens[False]
    base = Engine(EngineConfig(model=str(tmp_path / "model"), dtype="float32", device="cuda"))
    plain = [
        o.token_ids for o in base.generate(prompts, [SamplingParams(max_tokens=16, ignore_eos=True)] * 6)
    ]
    assert [t != p for t, p, a in zip(tokens[True], plain, which) if a] == [True] * 4  # the adapters ran
