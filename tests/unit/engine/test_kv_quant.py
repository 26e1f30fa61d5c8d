"""FP8 KV cache (``engine.kv_quant``): e4m3 values with a scale per layer, K or V
and KV head.

- Quantizing and dequantizing stays within e4m3's rounding; values past the
  range saturate; rescaling into other scales keeps the values.
- An engine with ``kv_cache_dtype: fp8`` holds twice the tokens of a bf16 one in
  the same memory; what it stores dequantizes to within e4m3's rounding of the
  K/V a float32 engine stores for the same prompt; prompts chunked or whole give
  the same tokens (attention reads K/V as the cache holds them), and the logits
  of a chunk attending over the cached FP8 prefix stay close to the float32
  engine's.
- A checkpoint's ``k_scale`` / ``v_scale`` are used instead of calibrating.
- Unsupported combinations are refused with a sentence naming the fix.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.bench.quant_accuracy import prompt_logits
from splitserve.cluster.config import ClusterConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kv_quant import FP8, FP8_MAX, dequantize, quantize, requantize
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, random_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_hf_checkpoint("llama", directory)
    return str(directory)


def test_round_trip_saturation_and_rescaling():
    torch.manual_seed(0)
    x = torch.randn(128, 2, 32) * torch.tensor([1.0, 10.0])[None, :, None]  # heads of different size
    scale = x.abs().amax(dim=(0, 2)) / 200
    q = quantize(x, scale)
    assert q.dtype == FP8
    back = dequantize(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2**-4 on normal values
    big = x.abs() > 1e-2 * x.abs().amax()
    assert ((back - x).abs()[big] / x.abs()[big]).max() <= 2**-4 + 1e-6
    assert dequantize(quantize(x * 1000, scale), scale, torch.float32).abs().amax() <= FP8_MAX * scale.max()
    # rescaling from scale into 2 x scale: the same values, coarser steps
    cache = q[None, None].reshape(1, 2, 4, 16, 2, 32).clone()  # [layers, kv, blocks, slots, heads, dim]
    before = cache.float() * scale[None, None, None, None, :, None]
    requantize(cache, torch.tensor([1, 3]), slice(None), scale.expand(1, 2, 2), 2 * scale.expand(1, 2, 2))
    after = cache.float() * (2 * scale)[None, None, None, None, :, None]
    torch.testing.assert_close(
        after[:, :, [1, 3]], before[:, :, [1, 3]], rtol=2**-3, atol=2 * scale.max().item()
    )
    untouched = q.reshape(1, 2, 4, 16, 2, 32).view(torch.uint8)[:, :, [0, 2]]
    assert torch.equal(cache.view(torch.uint8)[:, :, [0, 2]], untouched)


def test_an_fp8_cache_holds_twice_the_tokens_and_stores_the_kv_within_rounding(tiny):
    base = EngineConfig(model=tiny, dtype="bfloat16", kv_cache_memory_mib=1, enable_prefix_caching=False)
    bf16 = Engine(base)
    fp8 = Engine(dataclasses.replace(base, kv_cache_dtype="fp8"))
    assert fp8.kv_cache.tensor.dtype == FP8 and fp8.kv_cache.layout.dtype == "float8_e4m3fn"
    assert bf16.capacity.bytes_per_token == 2 * fp8.capacity.bytes_per_token
    assert fp8.capacity.num_tokens == 2 * bf16.capacity.num_tokens
    assert "fp8 KV cache" in fp8.summary
    scales = fp8.kv_cache.scales
    assert scales.shape == (2, 2, 2) and bool((scales > 0).all()) and len(set(scales.flatten().tolist())) > 1

    prompt = random_prompts([40], 512, seed=2)[0]

    def stored(engine: Engine) -> torch.Tensor:
        """The prompt's K/V as the engine's cache holds them: [layers, 2, tokens, heads, dim]."""
        rid = engine.add_request(prompt, SamplingParams(max_tokens=2))
        engine.step()  # the prompt is in the cache; the request still holds its blocks
        table = engine.requests[rid].seq.block_table
        cache = engine.kv_cache.tensor
        raw = cache.view(torch.uint8) if cache.dtype == FP8 else cache  # torch indexes no float8
        return raw[:, :, table].view(cache.dtype).flatten(2, 3)[:, :, : len(prompt)]

    ref = Engine(dataclasses.replace(base, dtype="float32", kv_cache_dtype="fp8"))
    # layer 0's K/V come straight from the embeddings (later layers' from attention over
    # rounded K/V): the same values in both engines, one rounded
    got, want = stored(ref)[:1], stored(Engine(dataclasses.replace(base, dtype="float32")))[:1]
    back = got.float() * ref.kv_cache.scales[:1, :, None, :, None]
    big = want.abs() > 0.05 * want.abs().amax()
    assert ((back - want).abs()[big] / want.abs()[big]).max() <= 2**-4 + 1e-5


def test_fp8_kv_is_chunking_invariant_and_its_logits_stay_close(tiny):
    prompts = random_prompts([20, 80, 150], 512, seed=1)
    base = EngineConfig(model=tiny, dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    f32, fp8 = Engine(base), Engine(dataclasses.replace(base, kv_cache_dtype="fp8"))
    # prompts attend over their K/V as the cache holds them, chunked or not
    chunked = Engine(dataclasses.replace(base, kv_cache_dtype="fp8", max_num_batched_tokens=16))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    whole = [c.token_ids for c in fp8.generate(prompts, params)]
    assert [c.token_ids for c in chunked.generate(prompts, params)] == whole
    for p in prompts:  # the second chunk attends over the first from the cache
        cached = len(p) // 2
        got, want = prompt_logits(fp8, p, cached_prefix=cached), prompt_logits(f32, p, cached_prefix=cached)
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        # a scale or dequantization gone wrong gives < 0.5
        assert cos.mean() > 0.99 and cos.min() > 0.95, cos
        assert cos.mean() < 1 - 1e-7  # the cache was read quantized


def test_a_checkpoints_kv_scales_are_used(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02 * (i + 1))
    save_file(tensors, str(path), metadata={"format": "pt"})
    engine = Engine(
        EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=32, kv_cache_dtype="fp8")
    )
    want = torch.tensor([[0.05, 0.02], [0.10, 0.04]])[:, :, None].expand(2, 2, 2)
    torch.testing.assert_close(engine.kv_cache.scales, want)


def test_unsupported_combinations_are_refused(tiny):
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or fp8"):
        EngineConfig(model=tiny, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="fp8 runs on the sdpa and triton attention backends; cpu cannot"):
        Engine(
            EngineConfig(
                model=tiny, dtype="float32", num_kv_blocks=8, kv_cache_dtype="fp8", attention_backend="cpu"
            )
        )
    fp8 = {"engine": {"kv_cache_dtype": "fp8"}}
    with pytest.raises(ValueError, match=r"same kv_cache_dtype \(prefill fp8, decode auto\)"):
        ClusterConfig.model_validate({"prefill": fp8})
    assert (
        ClusterConfig.model_validate({"prefill": fp8, "decode": fp8}).engine_config("decode").kv_cache_dtype
        == "fp8"
    )
