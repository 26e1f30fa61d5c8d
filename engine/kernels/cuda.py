"""Triton kernels for CUDA: the fused residual-add + RMSNorm (the same contract and
rounding points as the native CPU kernel, so ``RMSNorm`` uses either through
``LlamaModel.use_kernels``), the weight-only int8 matmul of ``Int8Linear`` and
the per-token FP8 quantization of ``Fp8Linear``'s activations.

Each replaces a chain of small torch kernels whose launches, not their bytes,
bound a decode step: a norm in torch is eight kernels, this is one. With
``TRITON_INTERPRET=1`` Triton runs them on CPU tensors, which is how the unit
tests check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None],
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0,
        )
        acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = (acc * scale[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


# Above this many rows a matmul is compute-bound: dequantize once and use cuBLAS.
INT8_KERNEL_MAX_ROWS = 128


# Tile (BLOCK_N, BLOCK_K, num_stages, num_warps) by BLOCK_M, the rows bucket.
INT8_TILES = {16: (32, 128, 3, 4), 32: (64, 128, 3, 4), 64: (64, 128, 3, 4), 128: (64, 128, 3, 4)}


def int8_weight_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` for x [M, K] (float), weight [N, K] int8
    and scale [N]: the int8 weight is read once and widened in registers (decode's
    few rows), or dequantized for cuBLAS above ``INT8_KERNEL_MAX_ROWS`` rows."""
    M = x.shape[0]
    if M > INT8_KERNEL_MAX_ROWS:
        return torch.nn.functional.linear(x, weight.to(x.dtype)) * scale
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
) -> torch.Tensor:
    """The kernel with an explicit tile (what ``gpu_bench --sweep`` times)."""
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
