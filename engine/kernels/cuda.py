"""Triton kernels for CUDA: the fused residual-add + RMSNorm (the same contract and
rounding points as the native CPU kernel, so ``RMSNorm`` uses either through
``DecoderModel.use_kernels``), the weight-only int8 matmul of ``Int8Linear`` and
the per-token FP8 quantization of ``Fp8Linear``'s activations; from ``fp8``,
the norm and SiLU·up emitting FP8 activations and the block-scaled FP8 GEMM;
and, from ``triton_moe``, the routed experts' fused kernels.

Each replaces a chain of small torch kernels whose launches, not their bytes,
bound a decode step: a norm in torch is eight kernels, this is one. With
``TRITON_INTERPRET=1`` Triton runs them on CPU tensors, which is how the unit
tests check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine import kv_quant
from splitserve.engine.kernels.fp8 import (  # noqa: F401  (part of the set)
    _INTERPRETED,
    _e4m3,
    add_rms_norm_fp8,
    block_fp8_mm,
    quantize_fp8_groups,
    silu_mul_fp8,
)
from splitserve.engine.kernels.triton_moe import fused_experts  # noqa: F401  (part of the set)


@triton.jit
def _add_rms_norm(x_ptr, delta_ptr, w_ptr, out_ptr, dim, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * dim + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * dim + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += delta`` in place (rounded to x's dtype), then returns
    ``weight * rmsnorm(x)`` with the product of the dtype-rounded norm; x is 2-D
    and contiguous, delta (if any) has its shape."""
    rows, dim = x.shape
    out = torch.empty_like(x)
    if rows:
        _add_rms_norm[(rows,)](
            x,
            x if delta is None else delta.contiguous(),
            weight,
            out,
            dim,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=triton.next_power_of_2(dim),
        )
    return out


@triton.jit
def _int8_weight_mm(
    x_ptr,  # [M, K] float
    w_ptr,  # [N, K] int8
    s_ptr,  # [N] float: per output channel scale
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_ROWS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        if W_ROWS:  # load the tile as stored, [BLOCK_N, BLOCK_K], and transpose in registers
            w = tl.load(
                w_ptr + rn[:, None] * stride_wn + kk[None, :],
                mask=(rn[:, None] < N) & (kk[None, :] < K),
                other=0,
            )
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            w = tl.load(
                w_ptr + rn[None, :] * stride_wn + kk[:, None],
                mask=(rn[None, :] < N) & (kk[:, None] < K),
                other=0,
            )
            acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = (acc * scale[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _dequantize_int8(w_ptr, s_ptr, out_ptr, K, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < K
    w = tl.load(w_ptr + row * K + cols, mask=ok, other=0).to(tl.float32)
    scale = tl.load(s_ptr + row).to(tl.float32)
    tl.store(out_ptr + row * K + cols, (w * scale).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale[:, None]`` in ``dtype`` (weight [N, K] int8, contiguous), in one
    pass: for the cuBLAS path of long prompts, where scaling the weight once is cheaper
    than scaling the [M, N] output (M > K there)."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    block = 1024
    _dequantize_int8[(n, triton.cdiv(k, block))](weight, scale, out, k, BLOCK=block)
    return out


# Tile (BLOCK_N, BLOCK_K, num_stages, num_warps, w_rows) by BLOCK_M, the rows bucket: the
# fastest of ``gpu_bench --sweep`` on an H100 (Llama-3-8B's linears, 2026-11-23).
INT8_TILES = {
    16: (64, 256, 3, 4, True),
    32: (32, 256, 3, 4, False),
    64: (32, 256, 3, 4, False),
    128: (64, 128, 4, 4, False),
}
# Above the largest bucket a matmul is compute-bound: dequantize once and use cuBLAS.
INT8_KERNEL_MAX_ROWS = max(INT8_TILES)


def int8_weight_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` for x [M, K] (float), weight [N, K] int8
    and scale [N]: the int8 weight is read once and widened in registers (decode's
    few rows), or dequantized for cuBLAS above ``INT8_KERNEL_MAX_ROWS`` rows."""
    M = x.shape[0]
    if M > INT8_KERNEL_MAX_ROWS:
        return torch.nn.functional.linear(x, dequantize_int8(weight, scale, x.dtype))
    block_m = next(b for b in sorted(INT8_TILES) if M <= b)
    return int8_weight_mm_tiled(x, weight, scale, block_m, *INT8_TILES[block_m])


def int8_weight_mm_tiled(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_m: int,
    block_n: int,
    block_k: int,
    num_stages: int,
    num_warps: int,
    w_rows: bool = False,
) -> torch.Tensor:
    """The kernel with an explicit tile (what ``gpu_bench --sweep`` times); ``w_rows``
    loads weight tiles [N, K] as stored (else as [K, N])."""
    x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _int8_weight_mm[grid](
        x,
        weight,
        scale,
        y,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        W_ROWS=w_rows,
        num_stages=num_stages,
        num_warps=num_warps,
    )
    return y


@triton.jit
def _quantize_fp8_rows(
    x_ptr, q_ptr, s_ptr, dim, FP8_MAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    amax = tl.zeros([BLOCK], tl.float32)
    for c in range(0, dim, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * dim + cols, mask=cols < dim, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), EPS) / FP8_MAX
    tl.store(s_ptr + row, scale)
    for c in range(0, dim, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * dim + cols, mask=cols < dim, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * dim + cols, q.to(q_ptr.dtype.element_ty), mask=cols < dim)


def quantize_fp8_rows(x: torch.Tensor, fp8_max: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_fp8`` in one kernel (two passes over each row, the second
    from cache): (float8_e4m3fn [M, K], float32 scale [M, 1]); x is 2-D."""
    x = x.contiguous()
    rows, dim = x.shape
    q = torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(dim), 2048)
        _quantize_fp8_rows[(rows,)](x, q, scale, dim, FP8_MAX=fp8_max, EPS=eps, BLOCK=block)
    return q, scale


# ``rope_and_cache`` writes an FP8 (e4m3) cache too, given its scales (the C++ set does not)
WRITES_FP8_KV = True


@triton.jit
def _rope_and_cache(
    qkv_ptr,  # [T, (H + 2 * KVH) * D]: q, k, v of each token
    cos_ptr,  # [T, D]
    sin_ptr,
    slot_ptr,  # [T]: flat cache slot of each token
    q_ptr,  # [T, H, D] out: rotated q
    k_ptr,  # [T, KVH, D] out: rotated k
    k_cache_ptr,  # [slots, KVH, D]
    v_cache_ptr,
    scales_ptr,  # [2, KVH] float32: an FP8 cache's K then V scales (KV_FP8), else unused
    stride_qkv,
    H: tl.constexpr,
    KVH: tl.constexpr,
    H_PAD: tl.constexpr,
    KVH_PAD: tl.constexpr,
    HALF: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches hold e4m3: k and v divided by their head's scale, saturated
    FP8_MAX: tl.constexpr,
    INTERPRETED: tl.constexpr,  # round to e4m3's grid first (``fp8._e4m3``)
):
    t = tl.program_id(0)
    D: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + t * D + i).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * D + HALF + i).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * D + i).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * D + HALF + i).to(tl.float32)[None, :]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = qkv_ptr + t * stride_qkv
    # q: rotate every head
    h = tl.arange(0, H_PAD)[:, None]
    ok = h < H
    x1 = tl.load(row + h * D + i[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + h * D + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
    out = q_ptr + t * H * D + h * D + i[None, :]
    tl.store(out, (x1 * c1 - x2 * s1).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(out + HALF, (x2 * c2 + x1 * s2).to(q_ptr.dtype.element_ty), mask=ok)
    # k: rotate, return it and write it to the cache; v: write it to the cache
    h = tl.arange(0, KVH_PAD)[:, None]
    ok = h < KVH
    x1 = tl.load(row + (H + h) * D + i[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + (H + h) * D + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
    k1 = (x1 * c1 - x2 * s1).to(k_ptr.dtype.element_ty)
    k2 = (x2 * c2 + x1 * s2).to(k_ptr.dtype.element_ty)
    tl.store(k_ptr + t * KVH * D + h * D + i[None, :], k1, mask=ok)
    tl.store(k_ptr + t * KVH * D + h * D + HALF + i[None, :], k2, mask=ok)
    cache = slot * KVH * D + h * D + i[None, :]
    v1 = tl.load(row + (H + KVH + h) * D + i[None, :], mask=ok, other=0.0)
    v2 = tl.load(row + (H + KVH + h) * D + HALF + i[None, :], mask=ok, other=0.0)
    if KV_FP8:  # as kv_quant.quantize: the rounded k (and v) over the head's scale, saturated
        k_scale = tl.load(scales_ptr + h, mask=ok, other=1.0)
        v_scale = tl.load(scales_ptr + KVH + h, mask=ok, other=1.0)
        k1 = _e4m3(tl.clamp(k1.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX), INTERPRETED)
        k2 = _e4m3(tl.clamp(k2.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX), INTERPRETED)
        v1 = _e4m3(tl.clamp(v1.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX), INTERPRETED)
        v2 = _e4m3(tl.clamp(v2.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX), INTERPRETED)
    out_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + cache, k1.to(out_ty), mask=ok)
    tl.store(k_cache_ptr + cache + HALF, k2.to(out_ty), mask=ok)
    tl.store(v_cache_ptr + cache, v1.to(out_ty), mask=ok)
    tl.store(v_cache_ptr + cache + HALF, v2.to(out_ty), mask=ok)


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary (NeoX halves) on q and k of the fused projection ``qkv`` [T, (H + 2 KVH) D],
    k and v written to the (contiguous) caches at ``slot_mapping``; returns q [T, H, D],
    k [T, KVH, D] and v (a view of qkv) as ``apply_rotary`` + ``index_copy_`` would, in
    one kernel with one rounding per value instead of three. An FP8 (e4m3) cache comes
    with its [2, KVH] ``kv_scales`` and is written as ``kv_quant.quantize`` of the
    returned k and v."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (kv_scales is not None):
        raise ValueError("an FP8 KV cache needs its kv_scales, and only an FP8 cache takes them")
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, num_kv_heads, D, dtype=qkv.dtype, device=qkv.device)
    if T:
        _rope_and_cache[(T,)](
            qkv,
            cos.reshape(T, D).contiguous(),
            sin.reshape(T, D).contiguous(),
            slot_mapping,
            q,
            k,
            k_cache,
            v_cache,
            kv_scales if fp8 else slot_mapping,  # (a placeholder pointer, never read)
            qkv.stride(0),
            H=num_heads,
            KVH=num_kv_heads,
            H_PAD=triton.next_power_of_2(num_heads),
            KVH_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=D // 2,
            KV_FP8=fp8,
            FP8_MAX=kv_quant.FP8_MAX,
            INTERPRETED=_INTERPRETED,
        )
    v = qkv[:, (num_heads + num_kv_heads) * D :].view(T, num_kv_heads, D)
    return q, k, v


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as F.silu's
    tl.store(out_ptr + row * inter + cols, (act * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``gate_up = [gate | up]`` [T, 2I] (contiguous), in one kernel."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = 1024
        _silu_mul[(T, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
