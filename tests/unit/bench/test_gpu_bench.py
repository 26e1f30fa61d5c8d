"""The GPU benchmark's accounting, on CPU: bytes a decode step reads, FLOPs of a
prefill, data-sheet peaks and the goal verdicts. (Its timings need CUDA: see
tests/gpu/test_gpu_bench.py; here a wall-clock timer stands in for CUDA events.)"""

from __future__ import annotations

import time

import pytest
import torch

from splitserve.bench import gpu_bench as gb


@pytest.fixture
def cpu_timer(monkeypatch):
    def wall_ms(fn, warmup=1, iters=1):
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(gb, "cuda_time_ms", wall_ms)
    monkeypatch.setattr(gb, "cuda_graph_recorder", lambda fn: fn)


def _linear_params(cfg) -> int:
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return cfg.num_layers * (h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h)


# bytes per weight, and bytes of scale per output channel
@pytest.mark.parametrize(
    "quantization, per_weight, per_scale", [("none", 2, 0), ("int8", 1, 2), ("fp8", 1, 4)]
)
def test_decode_reads_every_weight_once(cpu_timer, quantization, per_weight, per_scale):
    cfg = gb.model_config("tiny")
    model = gb.build(cfg, quantization, torch.device("cpu"))
    outputs = cfg.num_layers * (
        (cfg.q_size + 2 * cfg.kv_size) + cfg.hidden_size + 2 * cfg.intermediate_size + cfg.hidden_size
    )
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2
    head = cfg.vocab_size * cfg.hidden_size * 2
    expected = _linear_params(cfg) * per_weight + outputs * per_scale + norms + head
    row = gb.decode_row(model, cfg, quantization, batch=3, context=40, bw=1e11)
    assert row.weight_bytes == expected
    assert row.kv_bytes == 3 * 40 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert row.roofline_ms == pytest.approx((row.weight_bytes + row.kv_bytes) / 1e11 * 1e3)
    assert row.fraction == pytest.approx(row.roofline_ms / row.graph_ms)


def test_prefill_flops(cpu_timer):
    cfg = gb.model_config("tiny")
    model = gb.build(cfg, "none", torch.device("cpu"))
    t = 64
    row = gb.prefill_row(model, cfg, "none", t, peak=2.0)
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * t
    expected = 2 * t * _linear_params(cfg) + attention + 2 * cfg.hidden_size * cfg.vocab_size
    assert row.tflop * 1e12 == pytest.approx(expected)
    assert row.fraction == pytest.approx(row.tflops / 2.0)


def test_datasheet_peaks():
    assert gb.datasheet_peaks("NVIDIA H100 80GB HBM3") == {"bf16": 989.4, "fp8": 1978.9}
    assert gb.datasheet_peaks("NVIDIA H100 PCIe")["bf16"] == 756.0
    assert gb.datasheet_peaks("NVIDIA H200")["fp8"] == 1978.9
    assert gb.datasheet_peaks("NVIDIA A100-SXM4-80GB") is None


def test_goal_verdicts():
    def decode(ms):
        return gb.DecodeRow("none", "triton", 1, 1024, ms, ms, 16 * 10**9, 0, 5.0)

    def kv(ms_bf16, ms_fp8):
        return [
            gb.DecodeRow("none", "triton", 64, 4096, ms, ms, 16 * 10**9, 0, 5.0, kv_dtype)
            for kv_dtype, ms in (("bf16", ms_bf16), ("fp8", ms_fp8))
        ]

    def prefill(q, ms):
        return gb.PrefillRow(q, 8192, ms, 100.0, 1000.0 if q == "none" else 2000.0)

    def moe(graph_ms):  # the eager time is not what the goal reads
        return gb.DecodeRow("none", "triton", 16, 1024, 50.0, graph_ms, 10**9, 0, 3.4, model="moe")

    met = gb.Report(
        "H100",
        "x",
        3000,
        {},
        {},
        "data sheet",
        [decode(5.8), *kv(20.0, 15.0), moe(6.5)],
        [prefill("none", 200), prefill("fp8", 100)],
    )
    assert {k: v[2] for k, v in met.goals().items()} == {
        "decode B=1 bf16 (triton), fraction of roofline": True,  # 5/5.8 = 0.86
        "decode B=64 ctx=4096, fp8 KV / bf16 KV step": True,  # 0.75
        "prefill 8192 tokens, fp8 / bf16": True,  # 2.0
        "prefill 8192 tokens, fp8 fraction of fp8 peak": True,  # 1000/2000
        "MoE decode B=16, fraction of roofline": True,  # 3.4/6.5 = 0.52
    }
    missed = gb.Report(
        "H100",
        "x",
        3000,
        {},
        {},
        "",
        [decode(6.0), *kv(20.0, 17.0), moe(7.0)],
        [prefill("none", 200), prefill("fp8", 150)],
    )
    assert not any(v[2] for v in missed.goals().values())
    assert set(missed.to_json()["goals"]) == set(missed.goals())
