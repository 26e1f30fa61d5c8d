"""Quantized linear layers: FP8 (W8A8, for compute-bound prefill) and weight-only
int8 (W8A16, for memory-bound decode), chosen per worker by ``EngineConfig.quantization``.

FP8 (``Fp8Linear``)::

    weight  W_q = fp8_e4m3(W / s_w)     s_w[n] = max|W[n, :]| / 448   (per output channel)
    input   x_q = fp8_e4m3(x / s_x)     s_x[t] = max|x[t, :]| / 448   (per token, every call)
    output  y[t, n] = s_x[t] * s_w[n] * sum_k x_q[t, k] * W_q[n, k]

On GPUs with FP8 tensor cores (compute capability 8.9+) the sum is one
``torch._scaled_mm`` with row-wise scales; elsewhere the same formula runs in
float32 on the dequantized values ("exact-dequantizing fallback"), so CPU tests
check the numerics the GPU computes, up to accumulation order.

Int8 (``Int8Linear``): ``W_q = round(W / s)``, ``s[n] = max|W[n, :]| / 127``;
``y = (x @ W_q^T) * s`` with activations left in the model dtype. Decode reads
each weight once per step, so halving (vs bf16) or quartering (vs float32) the
bytes is what speeds it up. On CUDA a Triton kernel widens the int8 tiles in
registers (``splitserve.engine.kernels.cuda``: PyTorch's ``_weight_int8pack_mm``
runs there but measured 30-200x slower than bf16 on an H100); on CPU
``torch._weight_int8pack_mm`` where it runs, else it dequantizes on the fly.

Embeddings, norms and the LM head stay unquantized (as in vLLM's FP8 checkpoints).

On CUDA an FP8 linear's input may arrive already quantized (``Fp8Rows``): the
fused norm or SiLU·up before it emits e4m3 and scales in the grouping the linear
names (``fp8_input_group``), so no quantization pass runs between them
(``DecoderModel.use_kernels`` wires it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine import kernels
from splitserve.engine.model.replace import replace_children
from splitserve.wire.config import QUANTIZATIONS

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
INT8_MAX = 127
_EPS = 1e-12


def fp8_gemm_supported(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (Ada sm_89, Hopper sm_90 and later)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8: (``t_q`` float8_e4m3fn, ``scale`` float32 [rows, 1]) with ``t ≈ t_q * scale``."""
    t32 = t.float()
    scale = t32.abs().amax(dim=-1, keepdim=True).clamp(min=_EPS) / FP8_MAX
    return (t32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise symmetric int8: (``t_q`` int8, ``scale`` float32 [rows]) with ``t ≈ t_q * scale``."""
    t32 = t.float()
    scale = t32.abs().amax(dim=-1).clamp(min=_EPS) / INT8_MAX
    return (t32 / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


@dataclass(frozen=True)
class Fp8Rows:
    """Activations already in FP8: ``q`` e4m3 [T, K] and ``scale`` float32 [T, K / group]
    (``kernels.fp8``), and the dtype the linear returns its output in."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


class Fp8Linear(nn.Module):
    """W8A8 FP8 replacement for an ``nn.Linear`` (2-D input, inference only). On FP8
    tensor cores it also takes ``Fp8Rows`` quantized per token (``fp8_input_group``
    is then its input width; None where it takes only the model's dtype)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w_q, w_scale = quantize_fp8(linear.weight.detach())
        self.register_buffer("weight", w_q)  # [out, in] float8_e4m3fn
        self.register_buffer("weight_scale", w_scale.view(1, -1))  # [1, out] float32
        self.bias = linear.bias
        # _scaled_mm needs both GEMM dims divisible by 16.
        self.use_scaled_mm = (
            fp8_gemm_supported(w_q.device) and self.in_features % 16 == 0 and self.out_features % 16 == 0
        )
        triton_set = kernels.load_cuda() if self.use_scaled_mm else None
        # the activations' quantizer: one Triton kernel on CUDA, not torch's eight
        self.quantize_input = (
            quantize_fp8
            if triton_set is None
            else functools.partial(triton_set.quantize_fp8_rows, fp8_max=FP8_MAX, eps=_EPS)
        )
        self.fp8_input_group = self.in_features if triton_set is not None else None

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if self.use_scaled_mm:
            x_q, x_scale = (x.q, x.scale) if isinstance(x, Fp8Rows) else self.quantize_input(x)
            y = torch._scaled_mm(
                x_q,
                self.weight.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale,
                out_dtype=x.dtype,
            )
        else:
            x_q, x_scale = quantize_fp8(x)
            y = self.dequantized_matmul(x_q, x_scale).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized_matmul(self, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """The fallback: the FP8 product computed in float32 on exactly dequantized values."""
        return F.linear(x_q.float(), self.weight.float()) * x_scale * self.weight_scale


class Fp8CheckpointLinear(nn.Module):
    """A linear whose FP8 weights come from a pre-quantized checkpoint
    (``checkpoint_quant``): ``weight`` float8_e4m3fn [out, in] and ``weight_scale``
    float32 [out, in_blocks], ``W[n, k] = weight[n, k] * weight_scale[n, k // block]``.
    Built empty (the loader fills both). On a GPU with FP8 tensor cores: with one
    scale per row it runs as ``Fp8Linear`` (row-wise ``_scaled_mm``, activations
    quantized per token); with blocks (a power of two >= 16 columns) through the
    block-scaled Triton GEMM (``kernels.fp8.block_fp8_mm``, activations quantized
    per token and block). Either way it takes ``Fp8Rows`` in that grouping
    (``fp8_input_group``). Otherwise it dequantizes the weight for each call (the
    weight stays FP8 in memory). On CPU the loader replaces it by a float linear
    with the dequantized weight (``dequantized_linear``)."""

    def __init__(self, in_features: int, out_features: int, in_blocks: int, bias: bool):
        super().__init__()
        if in_features % in_blocks:
            raise ValueError(f"{in_features} input features do not split into {in_blocks} scale blocks")
        self.in_features, self.out_features, self.block = in_features, out_features, in_features // in_blocks
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale", torch.empty(out_features, in_blocks, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # set by ready(), once the weights are on their device
        self.use_scaled_mm = False
        self.block_kernel = None  # kernels.fp8.block_fp8_mm's set
        self.fp8_input_group: int | None = None

    def ready(self) -> None:
        """Choose the kernel once the weights are in place."""
        dev = self.weight.device
        tensor_cores = fp8_gemm_supported(dev)
        rows = self.weight_scale.shape[1] == 1
        self.use_scaled_mm = (
            rows and tensor_cores and self.in_features % 16 == 0 and self.out_features % 16 == 0
        )
        blocks_fit = self.block >= 16 and not self.block & (self.block - 1)
        if not rows and tensor_cores and blocks_fit:
            self.block_kernel = kernels.load_cuda()
        if self.use_scaled_mm:
            self.fp8_input_group = self.in_features
        elif self.block_kernel is not None:
            self.fp8_input_group = self.block

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.weight.shape
        blocks = self.weight_scale.shape[1]
        w = self.weight.float().view(n, blocks, k // blocks) * self.weight_scale[:, :, None]
        return w.view(n, k).to(dtype)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if self.block_kernel is not None:
            if not isinstance(x, Fp8Rows):
                x = Fp8Rows(*self.block_kernel.quantize_fp8_groups(x, self.block, FP8_MAX, _EPS), x.dtype)
            y = self.block_kernel.block_fp8_mm(x.q, x.scale, self.weight, self.weight_scale, x.dtype)
        elif self.use_scaled_mm:
            x_q, x_scale = (x.q, x.scale) if isinstance(x, Fp8Rows) else quantize_fp8(x)
            y = torch._scaled_mm(
                x_q,
                self.weight.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale.view(1, -1),
                out_dtype=x.dtype,
            )
        else:
            y = F.linear(x.float(), self.dequantized_weight()).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized_linear(self, dtype: torch.dtype) -> nn.Linear:
        """An ``nn.Linear`` in ``dtype`` holding this layer's dequantized weight."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = nn.Parameter(self.dequantized_weight(dtype), requires_grad=False)
        if self.bias is not None:
            lin.bias = self.bias
        return lin


class Int8Linear(nn.Module):
    """Weight-only int8 replacement for an ``nn.Linear`` (2-D input, inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w_q, scale = quantize_int8(linear.weight.detach())
        self.register_buffer("weight", w_q)  # [out, in] int8
        self.register_buffer("scale", scale.to(linear.weight.dtype))  # [out], model dtype
        self.bias = linear.bias
        triton_set = kernels.load_cuda() if w_q.device.type == "cuda" else None
        self.triton_mm = None if triton_set is None else triton_set.int8_weight_mm
        self.use_packed = self.triton_mm is None and _int8pack_mm_works(w_q.device.type, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton_mm is not None:
            y = self.triton_mm(x, self.weight, self.scale)
        elif self.use_packed:
            y = torch._weight_int8pack_mm(x, self.weight, self.scale)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias


@functools.cache
def _int8pack_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._weight_int8pack_mm`` runs for this device and dtype (it is
    not built for every backend/dtype pair); probed once on a tiny input."""
    try:
        x = torch.ones(1, 32, dtype=dtype, device=device_type)
        w = torch.ones(32, 32, dtype=torch.int8, device=device_type)
        s = torch.ones(32, dtype=dtype, device=device_type)
        torch._weight_int8pack_mm(x, w, s)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


_LAYERS = {"fp8": Fp8Linear, "int8": Int8Linear}


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace every ``nn.Linear`` inside the decoder layers of ``model`` with the
    ``method`` layer (in place, after the weights are loaded and moved to their
    device and dtype); returns how many were replaced. ``"none"`` does nothing."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    if method == "none":
        return 0
    return replace_children(model.get_submodule("layers"), nn.Linear, _LAYERS[method])
