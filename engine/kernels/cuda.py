"""Triton kernels for CUDA: the fused residual-add + RMSNorm (the same contract and
rounding points as the native CPU kernel, so ``RMSNorm`` uses either through
``LlamaModel.use_kernels``) and the weight-only int8 matmul of ``Int8Linear``.

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


def int8_weight_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` for x [M, K] (float), weight [N, K] int8
    and scale [N]: the int8 weight is read once and widened in registers (decode's
    few rows), or dequantized for cuBLAS above ``INT8_KERNEL_MAX_ROWS`` rows."""
    M, K = x.shape
    N = weight.shape[0]
    if M > INT8_KERNEL_MAX_ROWS:
        return torch.nn.functional.linear(x, weight.to(x.dtype)) * scale
    x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    block_n = 32 if M <= 16 else 64  # narrow tiles: enough programs to pull HBM at full rate
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
        BLOCK_K=128,
        num_warps=4,
    )
    return y
