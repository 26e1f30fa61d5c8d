"""The GPU paths against the hardware's limits (CUDA only).

    python -m splitserve.bench.gpu_bench [--shape llama3-8b] [--result-json out.json]

On a random-weight model with Llama-3-8B's shapes (speed does not depend on
weight values) it measures, in one run:

- HBM bandwidth (a device-to-device copy, bytes read + written) and the dense
  GEMM rate actually reached by an 8192³ bf16 and FP8 matmul, as baselines;
- decode step time (one token for each of B sequences with C tokens of context,
  eager and as a replayed CUDA graph) at B = 1, 16, 64, with the SDPA and the
  Triton paged-decode attention, next to the roofline
  bound (weight bytes + KV bytes read) / measured HBM bandwidth, printed as
  bound / measured: 1.0 would be the memory-bound limit;
- prefill of one T-token prompt (T = 2k, 8k): tokens/s and achieved TFLOP/s
  (2·T·weights + 2·L·H·D·T² causal attention), as a fraction of the dense
  peak of that precision (the data-sheet figure for H100/H200, else the GEMM
  rate measured above).

for bf16 weights, weight-only int8 and FP8 (W8A8). Then (``--kv-context``) the
decode step with a bf16 and with an FP8 KV cache (e4m3 read in place by the
Triton kernel) at a long context, and (``--moe``) a mixture-of-experts decode
step (Qwen3-30B-A3B's layer shape, ``MOE_LAYERS`` layers, random routing
weights: its roofline counts the experts a batch is expected to touch under
uniform routing), eager and replayed from a CUDA graph, its experts through
``triton_moe.fused_experts``; ``--moe-only`` runs just those rows, and with
``--sweep`` times the fused experts' tiles (``moe_sweep``) instead of the dense
kernels'. Goals (issues 6, 50 and 66): decode at B=1 within 85% of the
roofline; FP8 prefill >= 1.6x bf16 and >= 50% of the FP8 dense peak at 8k
tokens; the FP8-KV step at B=64 <= 0.8x the bf16-KV step; MoE decode at B=16
>= 0.5 of its roofline. flash-attn is not installed on these machines; the
SDPA backend's paged decode gathers each sequence's blocks first (extra KV
traffic the roofline does not count), the Triton kernel reads them in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from splitserve.bench.cuda_timing import cuda_time_ms
from splitserve.engine import kv_quant
from splitserve.engine.attention import SeqSpan, get_backend
from splitserve.engine.cuda_graphs import cuda_graph_recorder
from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.cpu_linear import PackedLinear
from splitserve.engine.model.decoder import DecoderModel
from splitserve.engine.model.llama import RMSNorm, StepContext
from splitserve.engine.model.loader import build_model
from splitserve.engine.model.quant import Fp8Linear, Int8Linear, fp8_gemm_supported, quantize_fp8

SHAPES = {
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "tiny": dict(  # for tests: the same code path in seconds
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    ),
}

# Dense (no sparsity) tensor-core peaks from NVIDIA's data sheets, TFLOP/s: (bf16, fp8).
DATASHEET_PEAKS = {"H200": (989.4, 1978.9), "H100 PCIe": (756.0, 1513.0), "H100": (989.4, 1978.9)}
BLOCK_SIZE = 16


@dataclass
class DecodeRow:
    quantization: str
    attention: str  # sdpa (gathers blocks) or triton (paged kernel, reads in place)
    batch: int
    context: int
    eager_ms: float
    graph_ms: float  # = eager_ms where the capture failed (``moe_row`` says why)
    weight_bytes: int
    kv_bytes: int
    roofline_ms: float
    kv_dtype: str = "bf16"  # or fp8 (e4m3 cache, per-head scales)
    model: str = "dense"  # or moe

    @property
    def fraction(self) -> float:
        """Roofline bound / measured (graph) step time."""
        return self.roofline_ms / self.graph_ms


@dataclass
class PrefillRow:
    quantization: str
    tokens: int
    ms: float
    tflop: float
    peak_tflops: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.ms / 1e3)

    @property
    def tflops(self) -> float:
        return self.tflop / (self.ms / 1e3)

    @property
    def fraction(self) -> float:
        return self.tflops / self.peak_tflops


@dataclass
class Report:
    device: str
    shape: str
    hbm_gb_s: float
    gemm_tflops: dict[str, float]  # measured 8192^3 rates, by precision
    peak_tflops: dict[str, float]  # what prefill fractions divide by
    peak_source: str
    decode: list[DecodeRow]
    prefill: list[PrefillRow]

    def goals(self) -> dict[str, tuple[float, float, bool]]:
        """name -> (measured, goal, met)."""
        out = {}
        dense = [r for r in self.decode if r.model == "dense" and r.kv_dtype == "bf16"]
        b1 = [r for r in dense if r.batch == 1 and r.quantization == "none"]
        if b1:
            best = max(b1, key=lambda r: r.fraction)
            name = f"decode B=1 bf16 ({best.attention}), fraction of roofline"
            out[name] = (best.fraction, 0.85, best.fraction >= 0.85)
        kv = {
            r.kv_dtype: r for r in self.decode if r.model == "dense" and r.batch == 64 and r.context >= 4096
        }
        if "bf16" in kv and "fp8" in kv:
            ratio = kv["fp8"].graph_ms / kv["bf16"].graph_ms
            out[f"decode B=64 ctx={kv['fp8'].context}, fp8 KV / bf16 KV step"] = (ratio, 0.8, ratio <= 0.8)
        moe = [r for r in self.decode if r.model == "moe" and r.batch == 16]
        if moe:
            out["MoE decode B=16, fraction of roofline"] = (moe[0].fraction, 0.5, moe[0].fraction >= 0.5)
        longest = max((r.tokens for r in self.prefill), default=0)
        by_q = {r.quantization: r for r in self.prefill if r.tokens == longest}
        if "none" in by_q and "fp8" in by_q:
            ratio = by_q["fp8"].tflops / by_q["none"].tflops
            out[f"prefill {longest} tokens, fp8 / bf16"] = (ratio, 1.6, ratio >= 1.6)
            frac = by_q["fp8"].fraction
            out[f"prefill {longest} tokens, fp8 fraction of fp8 peak"] = (frac, 0.5, frac >= 0.5)
        return out

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["decode"] = [{**dataclasses.asdict(r), "fraction": r.fraction} for r in self.decode]
        d["prefill"] = [
            {
                **dataclasses.asdict(r),
                "tokens_per_s": r.tokens_per_s,
                "tflops": r.tflops,
                "fraction": r.fraction,
            }
            for r in self.prefill
        ]
        d["goals"] = {k: {"measured": m, "goal": g, "met": ok} for k, (m, g, ok) in self.goals().items()}
        return d


def hbm_bandwidth(device: torch.device, nbytes: int = 2**31) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1e3)


def gemm_tflops(device: torch.device, n: int = 8192) -> dict[str, float]:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = {"bf16": 2 * n**3 / (cuda_time_ms(lambda: a @ b) / 1e3) / 1e12}
    if fp8_gemm_supported(device):
        a8, sa = quantize_fp8(a)
        b8, sb = quantize_fp8(b)
        sb = sb.view(1, -1)

        def fp8():
            return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        out["fp8"] = 2 * n**3 / (cuda_time_ms(fp8) / 1e3) / 1e12
    return out


def datasheet_peaks(name: str) -> dict[str, float] | None:
    for key, (bf16, fp8) in DATASHEET_PEAKS.items():
        if all(part in name for part in key.split()):
            return {"bf16": bf16, "fp8": fp8}
    return None


def model_config(shape: str) -> ModelConfig:
    from transformers import LlamaConfig

    return ModelConfig.from_hf(LlamaConfig(**SHAPES[shape], tie_word_embeddings=False))


def build(cfg: ModelConfig, quantization: str, device: torch.device, kernels: bool = True) -> DecoderModel:
    """A random-weight model; ``kernels``: the fused Triton norms (else torch's)."""
    return build_model(
        cfg,
        torch.bfloat16,
        device,
        cfg.max_position_embeddings,
        None,
        native_kernels=kernels,
        quantization=quantization,
        init_on_device=True,
    )


def weight_bytes(model: DecoderModel) -> int:
    """Bytes a decode step reads: every decoder and LM-head weight with its scales, and
    the norms (the embedding rows it reads are negligible)."""
    total = 0
    for m in model.modules():
        if isinstance(m, (Fp8Linear, Int8Linear)):
            total += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
        elif isinstance(m, PackedLinear):  # CPU only: oneDNN's copy of a float weight
            total += m.in_features * m.out_features * m.packed.element_size()
        elif isinstance(m, (torch.nn.Linear, RMSNorm)):
            total += m.weight.numel() * m.weight.element_size()
    return total


def _kv_cache(cfg: ModelConfig, num_blocks: int, device: torch.device, kv_dtype: str = "bf16") -> KVCache:
    """Values do not matter for speed; NaN-free keeps softmax honest (an FP8 cache:
    positive e4m3 bytes below 0x78, i.e. up to 240, with scales of 1/16)."""
    fp8 = kv_dtype == "fp8"
    layout = KVLayout(
        cfg.num_layers,
        num_blocks,
        BLOCK_SIZE,
        cfg.num_kv_heads,
        cfg.head_dim,
        "float8_e4m3fn" if fp8 else "bfloat16",
        kv_scales=kv_quant.SCHEME if fp8 else "none",
    )
    cache = KVCache(layout, device)
    if fp8:
        cache.tensor.view(torch.uint8).random_(0, 0x78)
        cache.scales.fill_(1 / 16)
    else:
        cache.tensor.normal_()
    return cache


def _step(
    model: DecoderModel,
    cache: KVCache,
    spans: list[SeqSpan],
    num_decodes: int,
    ids,
    positions,
    slots,
    attention: str = "sdpa",
):
    """Static tensors and a closure running one forward + logits of each sequence's last token."""
    dev = cache.tensor.device
    backend = get_backend(attention, dev)
    ctx = StepContext(
        torch.tensor(slots, device=dev), backend, backend.prepare(spans, num_decodes, BLOCK_SIZE, dev)
    )
    ids_t = torch.tensor(ids, device=dev)
    pos_t = torch.tensor(positions, device=dev)
    last = torch.tensor([s.q_start + s.q_len - 1 for s in spans], device=dev)

    def run():
        hidden = model(ids_t, pos_t, cache, ctx)
        return model.compute_logits(hidden.index_select(0, last))

    return run


def _decode_step(
    model: DecoderModel, cfg: ModelConfig, batch: int, context: int, attention: str, kv_dtype: str = "bf16"
):
    """One decode step of ``batch`` sequences of ``context`` tokens, as a closure (and its cache)."""
    dev = next(model.parameters()).device
    per_seq = -(-context // BLOCK_SIZE)
    cache = _kv_cache(cfg, batch * per_seq, dev, kv_dtype)
    spans = [SeqSpan(b, 1, context, list(range(b * per_seq, (b + 1) * per_seq))) for b in range(batch)]
    slots = [
        s.block_table[(context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE for s in spans
    ]
    run = _step(model, cache, spans, batch, [1] * batch, [context - 1] * batch, slots, attention)
    return run, cache


def decode_row(
    model: DecoderModel,
    cfg: ModelConfig,
    quantization: str,
    batch: int,
    context: int,
    bw: float,
    attention: str = "sdpa",
    kv_dtype: str = "bf16",
) -> DecodeRow:
    run, cache = _decode_step(model, cfg, batch, context, attention, kv_dtype)
    eager = cuda_time_ms(run)
    graphed = cuda_time_ms(cuda_graph_recorder(run))
    kv = batch * context * cfg.num_layers * 2 * cfg.kv_size * cache.tensor.element_size()  # K and V read once
    wb = weight_bytes(model)
    del cache
    roofline = (wb + kv) / bw * 1e3
    return DecodeRow(quantization, attention, batch, context, eager, graphed, wb, kv, roofline, kv_dtype)


# A mixture-of-experts shape per --shape: Qwen3-30B-A3B's layers (128 experts, top 8, 768 wide), fewer
# of them so that the model and a batch's KV fit one 80 GB GPU with room to spare.
MOE_LAYERS = 16
MOE_SHAPES = {}
MOE_SHAPES["llama3-8b"] = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=MOE_LAYERS,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
MOE_SHAPES["tiny"] = {  # for tests
    **MOE_SHAPES["llama3-8b"],
    **dict(vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_experts=16, num_hidden_layers=2),
}


def _moe_model(dev: torch.device, shape: str) -> tuple[ModelConfig, DecoderModel]:
    """The MoE shape's config and a random bf16 model of it on ``dev``."""
    from transformers import Qwen3MoeConfig

    cfg = ModelConfig.from_hf(Qwen3MoeConfig(**MOE_SHAPES[shape]))
    return cfg, build(cfg, "none", dev)


def moe_row(dev: torch.device, shape: str, batch: int, context: int, bw: float) -> DecodeRow:
    """A decode step of the MoE shape with the Triton attention and the fused experts
    (``triton_moe.fused_experts``), eager and replayed from a CUDA graph (a capture that
    fails is printed, and the row's graph time is the eager one); the roofline counts
    the non-expert weights, the experts a batch touches in expectation under uniform
    routing, E (1 - (1 - k/E)^B) per layer, and the KV."""
    from splitserve.engine.kernels.triton_moe import fused_experts
    from splitserve.engine.model.moe import Experts

    cfg, model = _moe_model(dev, shape)
    for m in model.moe_layers():
        m.grouped_kernel = fused_experts
    run, cache = _decode_step(model, cfg, batch, context, "triton")
    eager = cuda_time_ms(run)
    try:
        graphed = cuda_time_ms(cuda_graph_recorder(run))
    except RuntimeError as e:
        print(f"moe decode B={batch}: not captured in a CUDA graph: {e}", flush=True)
        graphed = eager
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    per_expert = sum(p[0].numel() * p.element_size() for m in experts[:1] for p in m.parameters())
    expert_params = {id(p) for m in experts for p in m.parameters()}
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
    e, k = cfg.moe.num_experts, cfg.moe.top_k
    touched = e * (1 - (1 - k / e) ** batch) * len(experts)
    wb = int(dense - model.embed_tokens.weight.numel() * 2 + touched * per_expert)
    kv = batch * context * cfg.num_layers * 2 * cfg.kv_size * 2
    del cache, model
    torch.cuda.empty_cache()
    return DecodeRow(
        "none", "triton", batch, context, eager, graphed, wb, kv, (wb + kv) / bw * 1e3, model="moe"
    )


def kernel_profile(run: Callable[[], object], label: str, steps: int = 3, top: int = 12) -> str:
    """The CUDA kernels of ``run`` (after a warm-up call), by GPU time per call: what
    a step spends beyond its bound, and how many launches it takes; with the wall time
    per call outside the profiler (GPU time well below it: the host is the bound)."""
    run()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - began) / steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    launches = sum(e.count for e in events) / steps
    gpu_ms = sum(e.self_device_time_total for e in events) / steps / 1e3
    lines = [f"profile {label}: {launches:.0f} kernels, {gpu_ms:.2f} ms GPU/step of {wall_ms:.2f} ms wall"]
    for e in events[:top]:
        lines.append(
            f"  {e.self_device_time_total / steps / 1e3:7.3f} ms {e.count / steps:6.0f}x  {e.key[:90]}"
        )
    return "\n".join(lines)


def moe_profile(dev: torch.device, shape: str, batch: int, context: int) -> str:
    """``kernel_profile`` of one eager decode step of the MoE shape (``moe_row``'s)."""
    cfg, model = _moe_model(dev, shape)
    run, cache = _decode_step(model, cfg, batch, context, "triton")
    profile = kernel_profile(run, f"moe decode B={batch} ctx={context} triton bf16 KV")
    del run, cache, model
    torch.cuda.empty_cache()
    return profile


def decode_profile(
    model: DecoderModel, cfg: ModelConfig, batch: int, context: int, attention: str, kv_dtype: str = "bf16"
) -> str:
    """``kernel_profile`` of one eager decode step of ``batch`` sequences."""
    run, _cache = _decode_step(model, cfg, batch, context, attention, kv_dtype)
    return kernel_profile(run, f"decode B={batch} ctx={context} {attention} {kv_dtype} KV")


def _prefill_step(model: DecoderModel, cfg: ModelConfig, tokens: int):
    """The prefill of one random ``tokens``-token prompt, as a closure (and its cache)."""
    dev = next(model.buffers()).device
    blocks = list(range(-(-tokens // BLOCK_SIZE)))
    cache = _kv_cache(cfg, len(blocks), dev)
    slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(tokens)]
    ids = torch.randint(0, cfg.vocab_size, (tokens,)).tolist()
    run = _step(model, cache, [SeqSpan(0, tokens, tokens, blocks)], 0, ids, list(range(tokens)), slots)
    return run, cache


def prefill_profile(model: DecoderModel, cfg: ModelConfig, tokens: int) -> str:
    """``kernel_profile`` of the prefill of one ``tokens``-token prompt."""
    run, _cache = _prefill_step(model, cfg, tokens)
    return kernel_profile(run, f"prefill T={tokens}", steps=2)


def prefill_row(
    model: DecoderModel, cfg: ModelConfig, quantization: str, tokens: int, peak: float
) -> PrefillRow:
    run, cache = _prefill_step(model, cfg, tokens)
    ms = cuda_time_ms(run, warmup=2, iters=5)
    linear = sum(m.in_features * m.out_features for m in model.layers.modules() if _is_linear(m))
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens**2  # causal QK^T and PV
    flop = 2 * tokens * linear + attention + 2 * cfg.hidden_size * cfg.vocab_size
    del cache
    return PrefillRow(quantization, tokens, ms, flop / 1e12, peak)


INT8_SWEEP = [
    (bn, bk, st, 4, rows)
    for bn in (32, 64, 128)
    for bk in (128, 256)
    for st in (3, 4)
    for rows in (False, True)
]


def sweep(cfg: ModelConfig, dev: torch.device, log: Callable[[str], None]) -> None:
    """Time the Triton kernels' tile choices on this GPU (to set their defaults):
    the int8 matmul on one layer's four linears per rows bucket, against the same
    layer in bf16 through cuBLAS, and the paged-decode tile and warps per batch and KV
    dtype (``bench.decode_attention``)."""
    from splitserve.bench import decode_attention
    from splitserve.engine.kernels import cuda

    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = [(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * inter, h), (h, inter)]
    ws = [
        (torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev), torch.rand(n, device=dev))
        for n, k in shapes
    ]
    ws = [(w, sc.to(torch.bfloat16)) for w, sc in ws]
    dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in shapes]
    nbytes = sum(n * k for n, k in shapes)
    for m in (1, 32, 64, 128):
        block_m = next(b for b in sorted(cuda.INT8_TILES) if m <= b)
        xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _, k in shapes]
        bf16 = sum(cuda_time_ms(lambda x=x, w=w: x @ w.t(), iters=10) for x, w in zip(xs, dense))
        results = []
        for tile in INT8_SWEEP:
            try:
                ms = sum(
                    cuda_time_ms(partial(cuda.int8_weight_mm_tiled, x, w, sc, block_m, *tile), iters=10)
                    for x, (w, sc) in zip(xs, ws)
                )
            except Exception as e:  # a tile this GPU cannot run (shared memory): skip it
                log(f"int8 tile {tile}: {type(e).__name__}")
                continue
            results.append((ms, tile))
        results.sort()
        now = {t: ms for ms, t in results}.get(cuda.INT8_TILES[block_m], float("nan"))
        log(
            f"sweep int8 M={m:<3} (BLOCK_M {block_m}): best {results[0][1]} {results[0][0]:.3f} ms "
            f"({nbytes / results[0][0] / 1e6:.0f} GB/s); current {cuda.INT8_TILES[block_m]} {now:.3f} ms; "
            f"bf16 cuBLAS {bf16:.3f} ms; top3 {[(round(ms, 3), t) for ms, t in results[:3]]}"
        )
    rows = decode_attention.sweep(
        (1, 16, 64), 1024, ("bf16", "fp8"), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, log
    )
    for line in decode_attention.summary(rows):
        log(f"sweep attention ctx=1024: {line}")


def moe_sweep(
    dev: torch.device,
    shape: str,
    log: Callable[[str], None],
    tokens: Sequence[int] = (16, 64, 4096),
    tiles: Sequence | None = None,
) -> list[tuple[int, object, float]]:
    """Time ``triton_moe.fused_experts`` on one MoE layer of ``shape`` (random bf16
    experts, tokens routed by the real rule from random logits) for each tile, the
    same tile for both kernels: per token count, the best and the current default
    (``UP_TILE`` / ``DOWN_TILE``), with the expert bytes touched per second. ``tiles``:
    ``triton_moe.Tile`` choices (default 24: columns 32-128, depth 64-128, 4 or 8
    warps, 3 or 4 stages). Returns (tokens, best tile, its ms) per token count."""
    from transformers import Qwen3MoeConfig

    from splitserve.engine.kernels import triton_moe
    from splitserve.engine.model.moe import route

    tiles = tiles or [
        triton_moe.Tile(bn, bk, w, st)
        for bn in (32, 64, 128)
        for bk in (64, 128)
        for w in (4, 8)
        for st in (3, 4)
    ]
    cfg = ModelConfig.from_hf(Qwen3MoeConfig(**MOE_SHAPES[shape]))
    e, h, inter = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    gate_up = torch.randn(e, 2 * inter, h, device=dev, dtype=torch.bfloat16) * 0.02
    down = torch.randn(e, h, inter, device=dev, dtype=torch.bfloat16) * 0.02
    per_expert = 3 * inter * h * 2
    best = []
    for t in tokens:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        weights, ids = route(torch.randn(t, e, device=dev), None, cfg.moe)
        touched = ids.unique().numel() * per_expert
        default = cuda_time_ms(partial(triton_moe.fused_experts, x, weights, ids, 0, gate_up, down), iters=10)
        results = []
        for tile in tiles:
            try:
                ms = cuda_time_ms(
                    partial(triton_moe.fused_experts, x, weights, ids, 0, gate_up, down, None, (tile, tile)),
                    iters=10,
                )
            except Exception as err:  # a tile this GPU cannot run (shared memory): skip it
                log(f"moe tile {tile}: {type(err).__name__}")
                continue
            results.append((ms, tile))
        results.sort(key=lambda r: r[0])
        ms, tile = results[0]
        log(
            f"sweep moe T={t:<5} best {tile} {ms:.3f} ms ({touched / ms / 1e6:.0f} GB/s of experts); "
            f"default {default:.3f} ms ({touched / default / 1e6:.0f} GB/s); "
            f"top3 {[(round(m, 3), (c.block_n, c.block_k, c.warps, c.stages)) for m, c in results[:3]]}"
        )
        best.append((t, tile, ms))
    return best


def _is_linear(m: torch.nn.Module) -> bool:
    return isinstance(m, (torch.nn.Linear, Fp8Linear, Int8Linear, PackedLinear))


def run(
    shape: str,
    batches: list[int],
    context: int,
    prefill_tokens: list[int],
    quantizations: list[str],
    log: Callable[[str], None] = print,
    attentions: tuple[str, ...] = ("sdpa", "triton"),
    kernels: bool = True,
    profile: bool = False,
    tune: bool = False,
    kv_context: int = 0,
    moe: bool = False,
) -> Report:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs a CUDA device")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    bw = hbm_bandwidth(dev)
    gemm = gemm_tflops(dev)
    peaks, source = datasheet_peaks(name), "data sheet"
    if peaks is None:
        peaks, source = gemm, "measured 8192^3 GEMM"
    log(
        f"{name}: HBM {bw / 1e9:.0f} GB/s; GEMM " + ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in gemm.items())
    )
    cfg = model_config(shape)
    if tune and quantizations:
        sweep(cfg, dev, log)
    if tune and moe:
        moe_sweep(dev, shape, log)
    report = Report(name, shape, bw / 1e9, gemm, peaks, source, [], [])
    for q in quantizations:
        if q == "fp8" and not fp8_gemm_supported(dev):
            log("fp8: this GPU has no FP8 tensor cores; skipped")
            continue
        model = build(cfg, q, dev, kernels)
        if profile:
            for b in sorted({batches[0], batches[-1]}):
                log(decode_profile(model, cfg, b, context, attentions[-1]))
            log(prefill_profile(model, cfg, max(prefill_tokens)))
        for attention in attentions:
            for b in batches:
                report.decode.append(decode_row(model, cfg, q, b, context, bw, attention))
                log(_fmt_decode(report.decode[-1]))
        for t in prefill_tokens:
            peak = peaks["fp8" if q == "fp8" else "bf16"]
            report.prefill.append(prefill_row(model, cfg, q, t, peak))
            log(_fmt_prefill(report.prefill[-1]))
        if kv_context and q == "none":
            for kv_dtype in ("bf16", "fp8"):
                for b in batches:
                    report.decode.append(decode_row(model, cfg, q, b, kv_context, bw, "triton", kv_dtype))
                    log(_fmt_decode(report.decode[-1]))
        del model
        torch.cuda.empty_cache()
    if moe:
        for b in batches:
            report.decode.append(moe_row(dev, shape, b, context, bw))
            log(_fmt_decode(report.decode[-1]))
    return report


def _name(q: str) -> str:
    return {"none": "bf16", "int8": "int8 weight-only", "fp8": "fp8 W8A8"}[q]


def _fmt_decode(r: DecodeRow) -> str:
    what = f"{r.model} {_name(r.quantization)}" + (" fp8 KV" if r.kv_dtype == "fp8" else "")
    return (
        f"decode  {what:24} {r.attention:6} B={r.batch:<3} ctx={r.context}: "
        f"eager {r.eager_ms:7.2f} ms, "
        f"graph {r.graph_ms:7.2f} ms, roofline {r.roofline_ms:7.2f} ms "
        f"({(r.weight_bytes + r.kv_bytes) / 1e9:.2f} GB) -> {r.fraction:.2f} of roofline"
    )


def _fmt_prefill(r: PrefillRow) -> str:
    return (
        f"prefill {_name(r.quantization):17} T={r.tokens:<5}: {r.ms:8.1f} ms, {r.tokens_per_s:9.0f} tok/s, "
        f"{r.tflops:6.1f} TFLOP/s = {r.fraction:.2f} of {r.peak_tflops:.0f} peak"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024, help="tokens of context per decoding sequence")
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--quantization", nargs="+", default=["none", "int8", "fp8"])
    ap.add_argument("--attention", nargs="+", default=["sdpa", "triton"], help="decode attention backends")
    ap.add_argument("--no-kernels", action="store_true", help="torch's norms instead of the Triton ones")
    ap.add_argument("--profile", action="store_true", help="print the kernels of a decode step")
    ap.add_argument("--sweep", action="store_true", help="first time the Triton kernels' tile choices")
    ap.add_argument(
        "--kv-context",
        type=int,
        default=0,
        help="also decode at this context with bf16 and FP8 KV (e.g. 4096)",
    )
    ap.add_argument("--moe", action="store_true", help="also a mixture-of-experts decode step per batch")
    ap.add_argument(
        "--moe-only", action="store_true", help="only the MoE rows (and, with --sweep, only its tiles)"
    )
    ap.add_argument("--result-json")
    args = ap.parse_args(argv)
    report = run(
        args.shape,
        args.batch,
        args.context,
        args.prefill_tokens,
        [] if args.moe_only else args.quantization,
        attentions=args.attention,
        kernels=not args.no_kernels,
        profile=args.profile,
        tune=args.sweep,
        kv_context=args.kv_context,
        moe=args.moe or args.moe_only,
    )
    print(
        f"peaks ({report.peak_source}): " + ", ".join(f"{k} {v:.0f}" for k, v in report.peak_tflops.items())
    )
    for goal, (measured, target, met) in report.goals().items():
        print(f"goal {goal}: {measured:.2f} (goal {target}) {'MET' if met else 'NOT MET'}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(report.to_json(), f, indent=2)


if __name__ == "__main__":
    main()
