"""The GPU paths on CUDA (skipped without it): FP8 through ``torch._scaled_mm``,
int8 weight-only, quantized engines against the reference, CUDA-graph replay of
a decode step, and the benchmark end to end on a tiny shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from splitserve.bench import gpu_bench as gb
from splitserve.bench.quant_accuracy import closeness
from splitserve.engine.engine import Engine
from splitserve.engine.model.quant import Fp8Linear, Int8Linear, fp8_gemm_supported, quantize_fp8
from splitserve.wire.config import EngineConfig
from tests.conftest import make_hf_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def test_fp8_linear_on_tensor_cores_matches_the_fallback():
    if not fp8_gemm_supported(CUDA):
        pytest.skip("no FP8 tensor cores on this GPU")
    torch.manual_seed(0)
    lin = nn.Linear(512, 256, bias=False, device=CUDA, dtype=torch.bfloat16)
    layer = Fp8Linear(lin)
    assert layer.use_scaled_mm
    x = torch.randn(64, 512, device=CUDA, dtype=torch.bfloat16)
    x_q, x_scale = quantize_fp8(x)
    torch.testing.assert_close(layer(x).float(), layer.dequantized_matmul(x_q, x_scale), rtol=2e-2, atol=2e-2)


def test_fp8_row_quantization_kernel_matches_torch():
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.quant import _EPS, FP8_MAX

    torch.manual_seed(0)
    x = torch.randn(37, 5000, device=CUDA, dtype=torch.bfloat16) * 3  # rows longer than one chunk
    x[3] = 0  # an all-zero row: the scale's floor, no NaN
    q, scale = cuda.quantize_fp8_rows(x, FP8_MAX, _EPS)
    q_ref, scale_ref = quantize_fp8(x)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0.07, atol=2e-3)  # one e4m3 step at most
    assert (q.float() == q_ref.float()).float().mean() > 0.99


@pytest.mark.parametrize("kv_heads", [8, 2, 1])  # GQA groups 1, 4, 8
def test_paged_decode_reads_a_bf16_query_over_an_fp8_cache(kv_heads):
    """The compiled kernel's e4m3 path (widened to bf16 in registers, tensor-core dots)
    against SDPA's dequantizing gathers of the same cache."""
    from splitserve.engine.attention import get_backend
    from tests.unit.engine.attention.test_triton_decode import fp8_case

    case, scales = fp8_case([1, 17, 300, 2000], 8, kv_heads, 128)
    q, k, v, k8, v8, spans = (t.to(CUDA) if isinstance(t, torch.Tensor) else t for t in case)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scales = scales.to(CUDA)
    got, want = (
        b.forward(q, k, v, k8, v8, b.prepare(spans, len(spans), 16, CUDA), 128**-0.5, scales).float()
        for b in (get_backend("triton", CUDA), get_backend("sdpa", CUDA))
    )
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group", [128, 4096])
def test_fp8_activation_kernels_match_torch_compiled(group):
    """The norm and SiLU·up emitting FP8, compiled: the scales torch computes from the
    bf16 kernels' outputs, values within one e4m3 step (the GPU's float32 division
    is not torch's to the last bit)."""
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.quant import _EPS, FP8_MAX
    from tests.unit.engine.test_fp8_kernels import grouped_reference

    torch.manual_seed(0)
    x = torch.randn(37, 4096, device=CUDA, dtype=torch.bfloat16)
    delta = torch.randn_like(x)
    weight = torch.randn(4096, device=CUDA, dtype=torch.bfloat16)
    gate_up = torch.randn(37, 2 * 4096, device=CUDA, dtype=torch.bfloat16) * 2
    x_ref = x.clone()
    cases = [
        (
            cuda.add_rms_norm_fp8(x, delta, weight, 1e-5, group, FP8_MAX, _EPS),
            cuda.add_rms_norm(x_ref, delta, weight, 1e-5),
        ),
        (cuda.silu_mul_fp8(gate_up, group, FP8_MAX, _EPS), cuda.silu_mul(gate_up)),
    ]
    for (q, scale), plain in cases:
        q_ref, scale_ref = grouped_reference(plain.float(), group)
        torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=0.07, atol=2e-3)
        assert (q.float() == q_ref.float()).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 16, 100, 2048])
def test_block_fp8_gemm_compiled_matches_the_dequantized_product(rows):
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.quant import _EPS, FP8_MAX
    from tests.unit.engine.test_fp8_kernels import dequantized, grouped_reference

    torch.manual_seed(rows)
    w_q, w_scale = grouped_reference(torch.randn(1000, 1024, device=CUDA), 128)
    x_q, x_scale = cuda.quantize_fp8_groups(torch.randn(rows, 1024, device=CUDA), 128, FP8_MAX, _EPS)
    got = cuda.block_fp8_mm(x_q, x_scale, w_q, w_scale, torch.bfloat16).float()
    want = torch.nn.functional.linear(dequantized(x_q, x_scale), dequantized(w_q, w_scale))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_int8_linear_on_cuda():
    torch.manual_seed(0)
    lin = nn.Linear(512, 256, bias=False, device=CUDA, dtype=torch.bfloat16)
    layer = Int8Linear(lin)
    x = torch.randn(8, 512, device=CUDA, dtype=torch.bfloat16)
    expected = (x.float() @ layer.weight.float().t()) * layer.scale.float()
    torch.testing.assert_close(layer(x).float(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("method, min_cos, min_top1", [("int8", 0.99, 0.85), ("fp8", 0.95, 0.60)])
def test_quantized_engine_on_cuda_stays_close(tmp_path, method, min_cos, min_top1):
    if method == "fp8" and not fp8_gemm_supported(CUDA):
        pytest.skip("no FP8 tensor cores on this GPU")
    make_hf_checkpoint("llama", tmp_path)
    cfg = dict(model=str(tmp_path), device="cuda", num_kv_blocks=32)
    reference = Engine(EngineConfig(**cfg, dtype="float32"))
    quantized = Engine(EngineConfig(**cfg, dtype="bfloat16", quantization=method))
    c = closeness(quantized, reference, random_prompts([5, 40, 77, 130], 512, seed=3))
    assert c.mean_cos >= min_cos and c.top1 >= min_top1, c


def test_decode_step_graph_replays_the_eager_result():
    cfg = gb.model_config("tiny")
    model = gb.build(cfg, "none", CUDA)
    cache = gb._kv_cache(cfg, 8, CUDA)
    spans = [gb.SeqSpan(0, 1, 40, [0, 1, 2]), gb.SeqSpan(1, 1, 17, [5, 6])]
    run = gb._step(model, cache, spans, 2, [3, 4], [39, 16], [2 * 16 + 7, 6 * 16 + 0])
    eager = run().clone()
    replay = gb.cuda_graph_recorder(run)
    out = replay()
    with torch.inference_mode():  # the graph's output is an inference tensor
        out.zero_()  # the next replay must write every logit again
    torch.testing.assert_close(replay(), eager)
    assert eager.shape == (2, cfg.vocab_size) and torch.isfinite(eager).all()


def test_a_moe_decode_step_graph_replays_the_eager_result():
    """The MoE shape's decode step (``triton_moe.fused_experts``) captured in a CUDA
    graph: the capture succeeds (nothing read back on the host) and a replay, with the
    output zeroed in between, gives the eager logits; replays count experts in place."""
    from splitserve.engine.kernels.triton_moe import fused_experts

    cfg, model = gb._moe_model(CUDA, "tiny")
    assert all(m.grouped_kernel is fused_experts for m in model.moe_layers())
    run, cache = gb._decode_step(model, cfg, 4, 64, "triton")
    eager = run().clone()
    replay = gb.cuda_graph_recorder(run)
    layer = model.moe_layers()[0]
    layer.take_routed()
    out = replay()
    with torch.inference_mode():
        out.zero_()
    torch.testing.assert_close(replay(), eager)
    assert sum(layer.take_routed()) == 2 * 4 * cfg.moe.top_k  # two replays of four rows


def test_the_moe_tile_sweep_times_each_tile():
    from splitserve.engine.kernels.triton_moe import Tile

    lines = []
    best = gb.moe_sweep(CUDA, "tiny", lines.append, tokens=(4,), tiles=[Tile(32, 64), Tile(64, 128, 8, 4)])
    assert [t for t, _, _ in best] == [4] and best[0][2] > 0
    assert len(lines) == 1 and "GB/s of experts" in lines[0]


@pytest.mark.parametrize("extra", [{}, {"window": 128, "sinks": True}, {"softcap": 30.0, "window": 64}])
@pytest.mark.parametrize("splits", [1, 7])
def test_triton_paged_decode_compiled_matches_sdpa(splits, extra):
    from splitserve.engine.attention import SeqSpan, get_backend
    from splitserve.engine.attention.triton_decode import paged_decode

    torch.manual_seed(0)
    k_cache = torch.randn(64, 16, 2, 128, device=CUDA, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(64).tolist()
    lens = [1, 100, 600]
    spans, used = [], 0
    for i, c in enumerate(lens):
        nb = -(-c // 16)
        spans.append(SeqSpan(i, 1, c, perm[used : used + nb]))
        used += nb
    q = torch.randn(3, 8, 128, device=CUDA, dtype=torch.bfloat16)
    k = torch.zeros(3, 2, 128, device=CUDA, dtype=torch.bfloat16)  # decode reads only the cache
    if extra.get("sinks"):  # gpt-oss's: one logit per query head
        extra = {**extra, "sinks": torch.randn(8, device=CUDA)}
    sdpa = get_backend("sdpa", CUDA)
    meta = sdpa.prepare(spans, 3, 16, CUDA)
    expected = sdpa.forward(q, k, k, k_cache, v_cache, meta, 128**-0.5, **extra)
    width = max(len(s.block_table) for s in spans)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in spans], device=CUDA)
    got = paged_decode(
        q, k_cache, v_cache, tables.int(), torch.tensor(lens, device=CUDA).int(), 128**-0.5, splits, **extra
    )
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_benchmark_end_to_end_on_a_tiny_shape(tmp_path):
    report = gb.run(
        "tiny", [1, 4], 64, [256], ["none", "int8", "fp8"], log=lambda s: None, kv_context=256, moe=True
    )
    quants = {"none", "int8"} | ({"fp8"} if fp8_gemm_supported(CUDA) else set())
    assert {r.quantization for r in report.decode} == quants
    dense = [r for r in report.decode if r.model == "dense" and r.context == 64]
    assert len(dense) == 2 * 2 * len(quants) and len(report.prefill) == len(quants)
    assert {r.attention for r in dense} == {"sdpa", "triton"}
    long = [(r.kv_dtype, r.batch) for r in report.decode if r.context == 256]
    assert long == [("bf16", 1), ("bf16", 4), ("fp8", 1), ("fp8", 4)]
    assert [r.batch for r in report.decode if r.model == "moe"] == [1, 4]
    assert report.hbm_gb_s > 100 and report.gemm_tflops["bf16"] > 1
    for r in report.decode:
        assert 0 < r.fraction and r.graph_ms > 0
    for r in report.prefill:
        assert 0 < r.fraction and r.tokens_per_s > 0
    gb.main(
        [
            "--shape",
            "tiny",
            "--batch",
            "1",
            "--prefill-tokens",
            "128",
            "--result-json",
            str(tmp_path / "r.json"),
        ]
    )
    assert (tmp_path / "r.json").exists()
    profile = gb.moe_profile(CUDA, "tiny", 2, 64)  # the device check's MoE profile
    assert profile.startswith("profile moe decode B=2") and "ms wall" in profile


def test_the_attention_sweep_runs_every_shape_and_marks_the_defaults():
    from splitserve.bench import decode_attention

    rows = decode_attention.sweep((1, 4), 256, ("bf16", "fp8"), 8, 2, 64, log=lambda s: None)
    assert {(r.kv_dtype, r.batch) for r in rows} == {(k, b) for k in ("bf16", "fp8") for b in (1, 4)}
    assert sum(r.default for r in rows) == 4 and all(r.gbps > 0 for r in rows)
    assert len(decode_attention.summary(rows)) == 4


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_an_fp8_checkpoint_stays_fp8_on_the_gpu_and_matches_its_dequantized_model(tmp_path, fmt):
    from splitserve.bench.fp8_checkpoint import write_fp8_checkpoint
    from splitserve.bench.quant_accuracy import prompt_logits
    from splitserve.engine.model.quant import Fp8CheckpointLinear

    make_hf_checkpoint("llama", tmp_path / "float")
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", fmt, 32, tmp_path / "deq")
    fp8, deq = (
        Engine(EngineConfig(model=str(tmp_path / d), device="cuda", dtype="bfloat16", num_kv_blocks=64))
        for d in ("fp8", "deq")
    )
    layers = [m for m in fp8.model.modules() if isinstance(m, Fp8CheckpointLinear)]
    assert len(layers) == 2 * 4 and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    tensor_cores = fp8_gemm_supported(CUDA)
    assert all(m.use_scaled_mm == (fmt == "channel" and tensor_cores) for m in layers)
    assert all((m.block_kernel is not None) == (fmt == "block" and tensor_cores) for m in layers)
    if tensor_cores:  # the norms hand the linears FP8 activations in their grouping
        layer = fp8.model.layers[0]
        want_group = 32 if fmt == "block" else 64
        assert layer.input_layernorm.fp8_group == layer.post_attention_layernorm.fp8_group == want_group
    p = random_prompts([40], 512, seed=1)[0]
    got, want = prompt_logits(fp8, p), prompt_logits(deq, p)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).mean() > 0.99
