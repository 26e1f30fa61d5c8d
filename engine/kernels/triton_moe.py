"""The routed experts of a MoE layer as two Triton grouped GEMMs (vLLM's fused-MoE
idea, written for this engine's stacked layout): no Python loop over experts, one
launch per GEMM whatever the routing.

The (token, expert) pairs come sorted by expert, ``counts[e]`` of them for expert e.
Each expert's run is padded to a multiple of ``BLOCK_M``, so a block of rows belongs
to one expert::

    padded positions   [e0 e0 e0 -  | e2 e2 e2 e2 | e2 -  -  - ]    BLOCK_M = 4
    rows               [t7 t1 t3 -1 | t0 t2 t5 t6 | t9 -1 -1 -1]    (-1: padding)
    expert of block    [0           | 2           | 2          ]

    _expert_gemm(x, gate_up, rows)        h [P, 2I]   rows of x gathered in the kernel
    silu(h[:, :I]) * h[:, I:]             a [P, I]
    _expert_gemm(a, down, own positions)  y [P, H]    -> the pairs' rows, in sorted order

Weights are read in their own layout (``gate_up [E, 2I, H]``, ``down [E, H, I]``).
With ``TRITON_INTERPRET=1`` it runs on CPU tensors (how the unit tests check it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _expert_gemm(
    a_ptr,  # [*, K] rows gathered through rows_ptr
    w_ptr,  # [E, N, K]
    out_ptr,  # [P, N]
    rows_ptr,  # [P] int32: the row of a for each padded position, -1 for padding
    expert_ptr,  # [P / BLOCK_M] int32: each block's expert
    K,
    N,
    stride_a,
    stride_we,
    stride_wn,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,  # float32 models: exact float32 products (no TF32 rounding)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + offs_m)
    valid = rows >= 0
    rows = tl.where(valid, rows, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0
        )
        w = tl.load(
            w_ptr + e * stride_we + offs_n[None, :] * stride_wn + ks[:, None],
            mask=(offs_n[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        if FP32_DOT:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _gemm(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[P, N]: padded position i = a[rows[i]] @ w[expert of its block]^T (padding left unset)."""
    n, k = w.shape[1], w.shape[2]
    out = a.new_empty((rows.shape[0], n))
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (experts.shape[0], triton.cdiv(n, block_n))
    _expert_gemm[grid](
        a,
        w,
        out,
        rows,
        experts,
        k,
        n,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP32_DOT=a.dtype == torch.float32,
    )
    return out


def grouped_experts_gemm(
    x: torch.Tensor, token: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Row ``x[token[i]]`` through expert e for the ``counts[e]`` consecutive i of
    expert e (the pairs sorted by expert), unweighted: [len(token), H] in that order.
    The contract of ``moe._grouped`` on ``x.index_select(0, token)``."""
    n = token.shape[0]
    if n == 0:
        return x.new_empty((0, down.shape[1]))
    dev = x.device
    c = torch.tensor(counts, dtype=torch.long)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    sorted_start = torch.cumsum(c, 0) - c
    padded_start = torch.cumsum(padded, 0) - padded
    expert = torch.repeat_interleave(torch.arange(len(counts)), c)  # of each sorted pair
    dest = (padded_start[expert] + torch.arange(n) - sorted_start[expert]).to(dev)
    total = int(padded.sum())
    rows = torch.full((total,), -1, dtype=torch.int32, device=dev)
    rows[dest] = token.to(torch.int32)
    blocks = torch.repeat_interleave(torch.arange(len(counts)), padded // BLOCK_M).to(dev, torch.int32)
    inter = down.shape[2]
    h = _gemm(x.contiguous(), gate_up, rows, blocks)
    act = F.silu(h[:, :inter]) * h[:, inter:]
    own = torch.where(rows >= 0, torch.arange(total, dtype=torch.int32, device=dev), -1)
    return _gemm(act.contiguous(), down, own, blocks).index_select(0, dest)
