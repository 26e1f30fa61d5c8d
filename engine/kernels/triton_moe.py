"""The routed experts of a MoE layer as two Triton kernels (vLLM's fused-MoE idea,
written for this engine's stacked layout): no Python loop over experts, no value
read back to the host, every shape fixed by the number of tokens, so a decode step
with MoE layers can be captured in a CUDA graph.

The T x k (token, expert) pairs are sorted by expert on the device (``align``), and
each expert's run padded to a multiple of ``BLOCK_M``, so a block of positions
belongs to one expert::

    pair p = t * k + j: token t's j-th choice; within an expert, pairs in order
    padded positions   [e0 e0 e0 -  | e2 e2 e2 e2 | e2 -  -  - | -  -  -  - ]   BLOCK_M = 4
    pairs              [p1 p3 p7 -1 | p0 p2 p5 p6 | p9 -1 -1 -1| -1 -1 -1 -1]  (-1: padding)
    expert of block    [0           | 2           | 2          | -1         ]  (-1: unused)

    _experts_up(x, gate_up, pairs)     a [P, I]   act(x[p // k] @ gate_up[e]^T + bias)
    _experts_down(a, down, pairs)      y [T*k, H] route weight of p * (a @ down[e]^T + bias)
    y.view(T, k, H).sum(1)             out [T, H]

The number of blocks is the most the routing can need, ``(T*k + m*(BLOCK_M - 1)) //
BLOCK_M`` with m = min(experts, T*k); blocks past the last used one hold expert -1
and end at once, so they cost a launch slot and no weight bytes. Pairs routed to an
expert this rank does not hold (expert parallelism) get no position; their rows of y
stay zero. Both GEMMs accumulate in float32, round each product to the model's dtype
where torch's ``F.linear`` would, and apply the activation (SwiGLU, or gpt-oss's
clamped form with biases, ``moe.ExpertForm``) in the first kernel's epilogue.
Weights are read in their own layout (``gate_up [E, 2I, H]``, ``down [E, H, I]``).
With ``TRITON_INTERPRET=1`` it runs on CPU tensors (how the unit tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16
SILU, CLAMPED_SWIGLU = 0, 1


@triton.jit
def _experts_up(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows, then up rows
    bias_ptr,  # [E, 2I] (HAS_BIAS)
    out_ptr,  # [P, I]
    pairs_ptr,  # [P] int32: the pair at each padded position, -1 for padding
    expert_ptr,  # [P / BLOCK_M] int32: each block's expert, -1 for an unused block
    H,
    INTER,
    TOPK,
    stride_x,
    stride_we,
    stride_wn,
    stride_be,
    stride_o,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,  # float32 models: exact float32 products (no TF32 rounding)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs >= 0
    token = tl.where(valid, pairs // TOPK, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < INTER
    w_gate = w_ptr + e * stride_we + offs_n[None, :] * stride_wn
    w_up = w_gate + INTER * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < H
        a = tl.load(
            x_ptr + token[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        wg = tl.load(w_gate + ks[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w_up + ks[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if FP32_DOT:
            acc_gate += tl.dot(a, wg, input_precision="ieee")
            acc_up += tl.dot(a, wu, input_precision="ieee")
        else:
            acc_gate += tl.dot(a, wg)
            acc_up += tl.dot(a, wu)
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc_gate += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_ptr + e * stride_be + INTER + offs_n, mask=n_ok, other=0.0).to(tl.float32)[
            None, :
        ]
    gate = acc_gate.to(dtype).to(tl.float32)  # where F.linear rounds h
    up = acc_up.to(dtype).to(tl.float32)
    if ACTIVATION == 0:
        act = gate * tl.sigmoid(gate) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out, act.to(dtype), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _experts_down(
    a_ptr,  # [P, I]
    w_ptr,  # [E, H, I]
    bias_ptr,  # [E, H] (HAS_BIAS)
    route_ptr,  # [T * k] float32: each pair's routing weight
    out_ptr,  # [T * k, H]
    pairs_ptr,
    expert_ptr,
    INTER,
    H,
    stride_a,
    stride_we,
    stride_wn,
    stride_be,
    stride_o,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs >= 0
    pairs = tl.where(valid, pairs, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < INTER
        a = tl.load(
            a_ptr + offs_m[:, None].to(tl.int64) * stride_a + ks[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + e * stride_we + offs_n[None, :] * stride_wn + ks[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if FP32_DOT:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc = acc.to(dtype).to(tl.float32)  # where F.linear rounds the expert's output
    route = tl.load(route_ptr + pairs, mask=valid, other=0.0)
    route = route.to(dtype).to(tl.float32)  # moe.grouped_experts scales in the model's dtype
    out = out_ptr + pairs[:, None] * stride_o + offs_n[None, :]
    tl.store(out, (acc * route[:, None]).to(dtype), mask=valid[:, None] & n_ok[None, :])


def max_blocks(pairs: int, experts: int, block_m: int = BLOCK_M) -> int:
    """The most blocks ``pairs`` (token, expert) pairs over ``experts`` experts can
    fill, each expert's run padded to ``block_m``: ``sum ceil(n_e / block_m)`` is at
    most ``(pairs + m * (block_m - 1)) // block_m`` for the m <= min(experts, pairs)
    experts with pairs."""
    return (pairs + min(experts, pairs) * (block_m - 1)) // block_m


def align(
    ids: torch.Tensor, first_expert: int, held: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [P] int32, expert of each block [P / block_m] int32) for expert ids
    ``ids`` [T, k] of which this rank holds ``[first_expert, first_expert + held)``:
    the layout of the module docstring, computed on ``ids``' device with no value read
    back and shapes that depend only on T * k (so a CUDA graph can capture it)."""
    dev = ids.device
    n = ids.numel()
    local = ids.reshape(-1) - first_expert
    key = torch.where((local >= 0) & (local < held), local, held)  # ``held``: an expert elsewhere
    counts = torch.zeros(held + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:held]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    sorted_start = counts.cumsum(0) - counts
    order = key.argsort(stable=True)
    expert = key.index_select(0, order)
    here = expert < held
    expert = expert.clamp(max=held - 1)
    dest = (
        padded_start.index_select(0, expert)
        + torch.arange(n, device=dev)
        - sorted_start.index_select(0, expert)
    )
    blocks = max_blocks(n, held, block_m)
    total = blocks * block_m
    dest = torch.where(here, dest, total)  # one slot past the end, cut off below
    pairs = torch.full((total + 1,), -1, dtype=torch.int32, device=dev)
    pairs = pairs.scatter_(0, dest, order.to(torch.int32))[:total]
    starts = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(starts < padded_end[-1], block_expert, -1).to(torch.int32)
    return pairs, block_expert


@dataclass(frozen=True)
class Tile:
    """A kernel's launch shape: output columns and reduction width per program, warps,
    pipeline stages (``bench.gpu_bench --sweep`` times the choices on a GPU)."""

    block_n: int = 64
    block_k: int = 64
    warps: int = 4
    stages: int = 3

    def fit(self, n: int, k: int) -> Tile:
        """This tile no wider than ``n`` columns and ``k`` deep (powers of two, >= 16)."""
        return Tile(
            min(self.block_n, max(16, triton.next_power_of_2(n))),
            min(self.block_k, max(16, triton.next_power_of_2(k))),
            self.warps,
            self.stages,
        )


UP_TILE, DOWN_TILE = Tile(), Tile()


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    form=None,
    tiles: tuple[Tile, Tile] | None = None,
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight x expert(x), [T, H] in ``x``'s
    dtype: the contract of ``moe.grouped_experts`` (``weights`` [T, k], ``ids`` [T, k],
    the stacks holding experts ``[first_expert, first_expert + E)``, ``form`` a
    ``moe.ExpertForm`` or None for plain SwiGLU): two kernels after ``align``'s few
    torch ops, none of which reads a value back.
    ``tiles``: the two kernels' launch shapes (default ``UP_TILE``, ``DOWN_TILE``)."""
    t, k = ids.shape
    held, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    if t == 0:
        return x.new_zeros((0, hidden))
    pairs, block_expert = align(ids, first_expert, held)
    x = x.contiguous()
    fp32 = x.dtype == torch.float32
    up_bias = None if form is None else form.gate_up_bias
    down_bias = None if form is None else form.down_bias
    clamped = form is not None and form.activation != "silu"
    up_tile, down_tile = tiles or (UP_TILE, DOWN_TILE)
    act = x.new_empty((pairs.shape[0], inter))
    tile = up_tile.fit(inter, hidden)
    _experts_up[(block_expert.shape[0], triton.cdiv(inter, tile.block_n))](
        x,
        gate_up,
        gate_up if up_bias is None else up_bias,
        act,
        pairs,
        block_expert,
        hidden,
        inter,
        k,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        0 if up_bias is None else up_bias.stride(0),
        act.stride(0),
        form.alpha if clamped else 0.0,
        form.limit if clamped else 0.0,
        HAS_BIAS=up_bias is not None,
        ACTIVATION=CLAMPED_SWIGLU if clamped else SILU,
        BLOCK_M=BLOCK_M,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        FP32_DOT=fp32,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )
    y = x.new_zeros((t * k, hidden))
    route = weights.reshape(-1).float().contiguous()
    tile = down_tile.fit(hidden, inter)
    _experts_down[(block_expert.shape[0], triton.cdiv(hidden, tile.block_n))](
        act,
        down,
        down if down_bias is None else down_bias,
        route,
        y,
        pairs,
        block_expert,
        inter,
        hidden,
        act.stride(0),
        down.stride(0),
        down.stride(1),
        0 if down_bias is None else down_bias.stride(0),
        y.stride(0),
        HAS_BIAS=down_bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        FP32_DOT=fp32,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )
    return y.view(t, k, hidden).sum(dim=1)
