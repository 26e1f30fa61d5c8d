"""FP8 activations and the block-scaled FP8 GEMM, in Triton (part of the CUDA set,
``kernels.load_cuda()``).

Activations are quantized per token and per group of ``group`` columns
(``group`` = the row's width: one scale per token, what ``torch._scaled_mm``'s
row-wise scaling takes; ``group`` = 128: DeepSeek-V3's 1x128 activation blocks)::

    scale[t, g] = max(max|x[t, g*group:(g+1)*group]|, eps) / 448
    q[t, k]     = e4m3(clamp(x[t, k] / scale[t, k // group], -448, 448))

``quantize_fp8_groups`` does it for any tensor; ``add_rms_norm_fp8`` and
``silu_mul_fp8`` emit it straight from the fused norm and SiLU·up (the same
values as the bf16 kernels' outputs rounded to the model dtype, then
quantized), so the linear after them reads one byte per value and no
quantization pass runs between (in the 8k-token FP8 prefill profile that pass
was 10 of 158 ms).

``block_fp8_mm`` is the GEMM of a block-quantized checkpoint
(``checkpoint_quant``: weight e4m3 [N, K], one scale per row and per block of
``block`` columns, activations quantized with ``group = block``)::

    y[t, n] = sum_b x_scale[t, b] * w_scale[n, b] * sum_{k in block b} q[t, k] * w[n, k]

each block's dot in FP8 tensor cores, scaled and summed in float32: the weight
is read once, as stored, instead of dequantized on every call.

With ``TRITON_INTERPRET=1`` Triton runs these on CPU tensors (dots in float32),
which is how the unit tests check them against torch. The interpreter's own
float32 → e4m3 conversion is wrong where rounding carries into the exponent
(124.6 becomes 64, not 128), so interpreted kernels round to e4m3's grid first
(``_e4m3``, half to even as torch does) and the conversion is then exact.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn

# Triton reads TRITON_INTERPRET once, at import; so does this module.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _group_pad(dim: int, group: int) -> tuple[int, int]:
    """(BLOCK, GROUP): the padded row width a program holds and the padded group; a
    group narrower than the row must be a power of two dividing it."""
    if dim % group:
        raise ValueError(f"{dim} columns do not split into groups of {group}")
    block = triton.next_power_of_2(dim)
    if group == dim:
        return block, block
    if group & (group - 1):
        raise ValueError(f"an FP8 activation group narrower than its row must be a power of two, got {group}")
    return block, group


@triton.jit
def _e4m3(y, INTERPRETED: tl.constexpr):
    """``y`` (float32 within ±448) for conversion to e4m3: as it is, compiled (the
    hardware rounds to nearest even); interpreted, rounded to nearest even on e4m3's
    grid (3 mantissa bits, subnormals below 2^-6)."""
    if INTERPRETED:
        a = tl.abs(y)
        ulp = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0) - 3.0)
        steps = a / ulp  # exact: ulp is a power of two
        low = tl.floor(steps)
        odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
        up = (steps - low > 0.5) | ((steps - low == 0.5) & odd)  # half to even
        r = (low + tl.where(up, 1.0, 0.0)) * ulp
        y = tl.where(r == 0, y * 0.0, tl.where(y < 0, -r, r))  # a zero keeps its sign
    return y


@triton.jit
def _quantize_store(
    y,
    q_ptr,
    s_ptr,
    row,
    dim,
    groups,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Quantize ``y`` ([BLOCK] float32, zero past ``dim``) in groups of GROUP; store
    the e4m3 values of row ``row`` and its ``groups`` scales."""
    y2 = tl.reshape(y, [BLOCK // GROUP, GROUP])
    scale = tl.maximum(tl.max(tl.abs(y2), axis=1), EPS) / FP8_MAX  # [BLOCK // GROUP]
    q = _e4m3(tl.minimum(tl.maximum(y2 / scale[:, None], -FP8_MAX), FP8_MAX), INTERPRETED)
    cols = tl.arange(0, BLOCK)
    tl.store(q_ptr + row * dim + cols, tl.reshape(q, [BLOCK]).to(q_ptr.dtype.element_ty), mask=cols < dim)
    g = tl.arange(0, BLOCK // GROUP)
    tl.store(s_ptr + row * groups + g, scale, mask=g < groups)


@triton.jit
def _quantize_fp8_groups(
    x_ptr,
    q_ptr,
    s_ptr,
    dim,
    groups,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    y = tl.load(x_ptr + row * dim + cols, mask=cols < dim, other=0.0).to(tl.float32)
    _quantize_store(y, q_ptr, s_ptr, row, dim, groups, FP8_MAX, EPS, BLOCK, GROUP, INTERPRETED)


def _outputs(rows: int, dim: int, group: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(rows, dim, dtype=FP8, device=device)
    return q, torch.empty(rows, dim // group, dtype=torch.float32, device=device)


def quantize_fp8_groups(
    x: torch.Tensor, group: int, fp8_max: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as (e4m3 [M, K], float32 scales [M, K / group]); ``group`` = K is the
    per-token quantization of ``quant.quantize_fp8``."""
    x = x.contiguous()
    rows, dim = x.shape
    q, scale = _outputs(rows, dim, group, x.device)
    if rows:
        block, g = _group_pad(dim, group)
        _quantize_fp8_groups[(rows,)](
            x,
            q,
            scale,
            dim,
            dim // group,
            FP8_MAX=fp8_max,
            EPS=eps,
            BLOCK=block,
            GROUP=g,
            INTERPRETED=_INTERPRETED,
        )
    return q, scale


@triton.jit
def _add_rms_norm_fp8(
    x_ptr,
    delta_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    dim,
    groups,
    eps,
    HAS_DELTA: tl.constexpr,
    FP8_MAX: tl.constexpr,
    Q_EPS: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
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
    y = (w * normed).to(x_ptr.dtype.element_ty).to(tl.float32)  # the bf16 kernel's output, then quantized
    _quantize_store(y, q_ptr, s_ptr, row, dim, groups, FP8_MAX, Q_EPS, BLOCK, GROUP, INTERPRETED)


def add_rms_norm_fp8(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group: int,
    fp8_max: float,
    q_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cuda.add_rms_norm`` (``x += delta`` in place, then the norm rounded to x's
    dtype) quantized as ``quantize_fp8_groups`` would quantize it, in one kernel."""
    rows, dim = x.shape
    q, scale = _outputs(rows, dim, group, x.device)
    if rows:
        block, g = _group_pad(dim, group)
        _add_rms_norm_fp8[(rows,)](
            x,
            x if delta is None else delta.contiguous(),
            weight,
            q,
            scale,
            dim,
            dim // group,
            eps,
            HAS_DELTA=delta is not None,
            FP8_MAX=fp8_max,
            Q_EPS=q_eps,
            BLOCK=block,
            GROUP=g,
            INTERPRETED=_INTERPRETED,
        )
    return q, scale


@triton.jit
def _silu_mul_fp8(
    gate_up_ptr,
    q_ptr,
    s_ptr,
    inter,
    groups,
    group,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (row, g): columns [g * group, (g + 1) * group) in chunks of BLOCK, twice
    (the amax, then the values, recomputed from cache)."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    base = gate_up_ptr + row * 2 * inter
    amax = tl.zeros([BLOCK], tl.float32)
    for c in range(0, group, BLOCK):
        cols = g * group + c + tl.arange(0, BLOCK)
        ok = (c + tl.arange(0, BLOCK) < group) & (cols < inter)
        gate = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(base + inter + cols, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)  # rounded as F.silu's
        amax = tl.maximum(amax, tl.abs((act * up).to(DTYPE).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), EPS) / FP8_MAX
    tl.store(s_ptr + row * groups + g, scale)
    for c in range(0, group, BLOCK):
        cols = g * group + c + tl.arange(0, BLOCK)
        ok = (c + tl.arange(0, BLOCK) < group) & (cols < inter)
        gate = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(base + inter + cols, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
        y = (act * up).to(DTYPE).to(tl.float32)
        q = _e4m3(tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX), INTERPRETED)
        tl.store(q_ptr + row * inter + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def silu_mul_fp8(
    gate_up: torch.Tensor, group: int, fp8_max: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cuda.silu_mul`` (``F.silu(gate) * up`` of ``[gate | up]`` [T, 2I], rounded to its
    dtype) quantized in groups of ``group`` columns of I, in one kernel."""
    rows, two_i = gate_up.shape
    inter = two_i // 2
    q, scale = _outputs(rows, inter, group, gate_up.device)
    if rows:
        _group_pad(inter, group)
        _silu_mul_fp8[(rows, inter // group)](
            gate_up.contiguous(),
            q,
            scale,
            inter,
            inter // group,
            group,
            FP8_MAX=fp8_max,
            EPS=eps,
            DTYPE=_TL_DTYPES[gate_up.dtype],
            BLOCK=min(triton.next_power_of_2(group), 1024),
            INTERPRETED=_INTERPRETED,
        )
    return q, scale


@triton.jit
def _block_fp8_mm(
    x_ptr,  # [M, K] e4m3
    xs_ptr,  # [M, KB] float32
    w_ptr,  # [N, K] e4m3
    ws_ptr,  # [N, KB] float32
    y_ptr,  # [M, N]
    M,
    N,
    KB,  # K // BLOCK_K: scale blocks along K
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the checkpoint's block: one scale per (row, BLOCK_K columns)
    FP32_DOT: tl.constexpr,  # the interpreter: dots in float32
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        kk = kb * BLOCK_K + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :], other=0.0)  # [BK, BN]
        xs = tl.load(xs_ptr + rm * KB + kb, mask=m_ok, other=0.0)
        ws = tl.load(ws_ptr + rn * KB + kb, mask=n_ok, other=0.0)
        if FP32_DOT:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w)
        acc += part * xs[:, None] * ws[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


# (BLOCK_N, num_warps, num_stages) by BLOCK_M, the rows bucket; not yet tuned on a GPU
# (vLLM's defaults for DeepSeek-V3's 128-column blocks, no sweep).
BLOCK_FP8_TILES = {16: (64, 4, 3), 32: (64, 4, 3), 64: (128, 4, 3), 128: (128, 8, 3)}


def block_fp8_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y [M, N] in ``out_dtype`` of e4m3 activations x_q [M, K] with scales [M, K / b]
    and an e4m3 weight [N, K] with scales [N, K / b] (both contiguous): one scale
    per row and block of b = K / KB columns, b a power of two >= 16."""
    M, K = x_q.shape
    N, kb = weight_scale.shape
    block_k = K // kb
    if (
        x_scale.shape != (M, kb)
        or weight.shape != (N, K)
        or K % kb
        or block_k & (block_k - 1)
        or block_k < 16
    ):
        raise ValueError(
            f"block_fp8_mm: x {tuple(x_q.shape)} / {tuple(x_scale.shape)}, "
            f"weight {tuple(weight.shape)} / {tuple(weight_scale.shape)} do not match in power-of-two blocks"
        )
    y = torch.empty(M, N, dtype=out_dtype, device=x_q.device)
    if M == 0:
        return y
    block_m = next((b for b in sorted(BLOCK_FP8_TILES) if M <= b), max(BLOCK_FP8_TILES))
    block_n, warps, stages = BLOCK_FP8_TILES[block_m]
    _block_fp8_mm[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
        x_q,
        x_scale,
        weight,
        weight_scale,
        y,
        M,
        N,
        kb,
        x_q.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP32_DOT=_INTERPRETED,
        num_warps=warps,
        num_stages=stages,
    )
    return y
