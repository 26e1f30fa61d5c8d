"""The Llama family's blocks, which the other families share (``engine.model.decoder``
assembles them): RMSNorm, GQA attention over the paged cache, the dense SiLU MLP,
and the ``StepContext`` every layer reads. Each holds this rank's shard
(``splitserve.engine.parallel.layers``); q/k/v and gate/up projections are fused
into single matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import AttentionBackend
from splitserve.engine.kv_quant import as_bytes, calibrated_scales, quantize
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.quant import _EPS, FP8_MAX, Fp8Rows
from splitserve.engine.model.rope import apply_rotary
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.layers import RowParallelLinear, kv_head_range


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as the reference implementations do.

    ``forward(x, delta)`` first adds ``delta`` into ``x`` **in place** (the residual
    stream) and normalises the sum, so each layer reads the stream once. With
    ``kernels`` set (C++ on CPU, Triton on CUDA) 2-D inputs take the fused kernel,
    which with ``fp8_group`` (the FP8 linear it feeds takes ``Fp8Rows`` in groups of
    that many columns) returns ``Fp8Rows``.

    With ``unit_offset`` (Gemma) the scale is ``1 + weight`` and is applied in float32
    before the cast back, as Gemma's reference does; the kernels do not run it."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self.kernels: Any = None
        self.fp8_group: int | None = None

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor | Fp8Rows:
        if self.unit_offset:
            if delta is not None:
                x.add_(delta)
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        if self.kernels is not None and x.dim() == 2 and x.is_contiguous():
            if self.fp8_group is not None:
                q, scale = self.kernels.add_rms_norm_fp8(
                    x, delta, self.weight, self.eps, self.fp8_group, FP8_MAX, _EPS
                )
                return Fp8Rows(q, scale, x.dtype)
            return self.kernels.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    """This rank's query heads and the KV heads they attend to (``kv_head_range``);
    layer ``index``'s sliding window, if it has one (``ModelConfig.window``), with
    ``cfg.attn_sinks`` this rank's heads' sink logits (``sinks``), the cap on its
    logits where the model soft-caps them (``softcap``: Gemma 2), and with
    ``cfg.attn_output_gate`` (Qwen3-Next, Qwen3.5) each head's output scaled by the
    sigmoid of a gate ``q_proj`` gives beside its query."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None, index: int = 0):
        super().__init__()
        tp = tp or TPGroup.single()
        h0, h1 = tp.shard_range(cfg.num_heads)
        k0, k1 = kv_head_range(cfg.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = h1 - h0, k1 - k0, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        # with an output gate (Qwen3-Next, Qwen3.5) each head's rows are its query, then its gate
        self.gated = cfg.attn_output_gate
        self.q_rows = self.q_size * (2 if self.gated else 1)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_rows + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        norm = cfg.norm_unit_offset
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, norm) if cfg.qk_norm else None
        self.window = cfg.window(index)
        self.rotary_dim = cfg.rope_dim
        self.softcap = cfg.attn_softcap
        self.sinks = None
        if cfg.attn_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.kernels: Any = None  # with ``rope_and_cache``: rotary + KV write in one kernel

    def forward(self, x, cos, sin, k_cache, v_cache, ctx: StepContext, kv_scales=None) -> torch.Tensor:
        """``kv_scales``: an FP8 cache's [2, kv_heads] K and V scales of this layer
        (``engine.kv_quant``), which ``ctx.calibrate_kv`` sets from this step's K and V.
        ``x`` may come quantized (``Fp8Rows``) for an FP8 ``qkv_proj``."""
        qkv = self.qkv_proj(x)
        T = qkv.shape[0]
        gate = None
        if self.gated:
            q_gate, kv = qkv.split([self.q_rows, 2 * self.kv_size], dim=-1)
            q, gate = q_gate.view(T, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            qkv = torch.cat([q.reshape(T, self.q_size), kv], dim=-1)
        fused = getattr(self.kernels, "rope_and_cache", None)
        # an FP8 cache only where the kernel writes e4m3 (the Triton set), not while calibrating
        fp8_ok = kv_scales is None or (getattr(self.kernels, "WRITES_FP8_KV", False) and not ctx.calibrate_kv)
        whole = self.rotary_dim == self.head_dim  # the kernels turn whole heads
        if fused is not None and self.q_norm is None and whole and k_cache.is_contiguous() and fp8_ok:
            heads = (self.num_heads, self.num_kv_heads)
            fp8 = {} if kv_scales is None else {"kv_scales": kv_scales}
            q, k, v = fused(qkv, cos, sin, k_cache, v_cache, ctx.slot_mapping, *heads, **fp8)
        else:
            q, k, v = self._rope_and_cache(
                qkv, cos, sin, k_cache, v_cache, ctx.slot_mapping, kv_scales, ctx.calibrate_kv
            )
        extra = {}  # only for a backend that takes them (``windows_and_sinks``)
        if self.window is not None or self.sinks is not None or self.softcap is not None:
            extra = {"window": self.window, "sinks": self.sinks, "softcap": self.softcap}
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.attn_meta, self.scale, kv_scales, **extra)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(T, self.q_size))

    def _rope_and_cache(
        self, qkv, cos, sin, k_cache, v_cache, slot_mapping, kv_scales=None, calibrate: bool = False
    ):
        """q, k, v of each token (q/k normed if the model has it, then rotated); k and v
        written to the caches at ``slot_mapping`` (an FP8 cache's quantized with its
        ``kv_scales``, which ``calibrate`` first sets from these K and V). In torch ops;
        ``kernels`` may fuse it."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        flat = (-1, self.num_kv_heads, self.head_dim)
        if kv_scales is None:
            k_cache.view(flat).index_copy_(0, slot_mapping, k)
            v_cache.view(flat).index_copy_(0, slot_mapping, v)
            return q, k, v
        if calibrate:
            kv_scales.copy_(calibrated_scales(k, v))
        as_bytes(k_cache).view(flat).index_copy_(0, slot_mapping, as_bytes(quantize(k, kv_scales[0])))
        as_bytes(v_cache).view(flat).index_copy_(0, slot_mapping, as_bytes(quantize(v, kv_scales[1])))
        return q, k, v


class MLP(nn.Module):
    """This rank's slice of the intermediate width (gate and up rows, down columns);
    ``intermediate_size`` defaults to the model's (MoE shared experts have their own).
    ``act(gate) * up`` with the model's activation: SiLU, or (Gemma) GELU's tanh
    approximation, which the fused kernels do not run."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None, intermediate_size: int | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.inter = (intermediate_size or cfg.intermediate_size) // tp.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, False, tp)
        self.kernels: Any = None  # with ``silu_mul``: the activation in one kernel
        self.fp8_group: int | None = None  # with it: the activation in FP8 for down_proj

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.split(self.inter, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        fused = getattr(self.kernels, "silu_mul", None)
        if fused is not None and gate_up.is_contiguous():
            if self.fp8_group is not None:
                q, scale = self.kernels.silu_mul_fp8(gate_up, self.fp8_group, FP8_MAX, _EPS)
                return self.down_proj(Fp8Rows(q, scale, gate_up.dtype))
            return self.down_proj(fused(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class StepContext:
    """What every layer needs about the current step, built once by the runner."""

    def __init__(
        self,
        slot_mapping: torch.Tensor,
        backend: AttentionBackend,
        attn_meta: Any,
        on_layer: Callable[[int], None] | None = None,
        calibrate_kv: bool = False,
        delta_spans: list | None = None,
    ):
        self.slot_mapping = slot_mapping
        self.backend = backend
        self.attn_meta = attn_meta
        self.on_layer = on_layer  # called with i once layer i wrote its KV
        self.calibrate_kv = calibrate_kv  # an FP8 cache takes its scales from this step's K and V
        # a hybrid model: each sequence's span and state slot (``deltanet.DeltaSpan``)
        self.delta_spans = delta_spans
        # layer groups (``KVLayout.grouped``): every group's context, this one first
        self.groups: list[StepContext] | None = None

    def of(self, group: int) -> StepContext:
        """The context of the layers of layer group ``group`` (their slots and attention
        metadata over their group's tables): this one without layer groups."""
        return self if self.groups is None else self.groups[group]
