"""The Llama-family decoder, written for packed variable-length batches over a
paged KV cache, each rank of a tensor-parallel group building only its shard
(``splitserve.engine.parallel.layers``).

Input is one flat batch of ``T`` tokens from many sequences (no padding); the
attention backend knows where each sequence starts and which cache blocks hold
its past. q/k/v and gate/up projections are fused into single matmuls. Weight
names follow Hugging Face checkpoints so loading is a rename, not a rewrite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import AttentionBackend
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_quant import as_bytes, calibrated_scales, quantize
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.rope import RotaryEmbedding, apply_rotary
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    kv_head_range,
)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as the reference implementations do.

    ``forward(x, delta)`` first adds ``delta`` into ``x`` **in place** (the residual
    stream) and normalises the sum, so each layer reads the stream once. With
    ``kernels`` set (C++ on CPU, Triton on CUDA) 2-D inputs take the fused kernel."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: Any = None

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.is_contiguous():
            return self.kernels.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    """This rank's query heads and the KV heads they attend to (``kv_head_range``)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        h0, h1 = tp.shard_range(cfg.num_heads)
        k0, k1 = kv_head_range(cfg.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = h1 - h0, k1 - k0, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.kernels: Any = None  # with ``rope_and_cache``: rotary + KV write in one kernel

    def forward(self, x, cos, sin, k_cache, v_cache, ctx: StepContext, kv_scales=None) -> torch.Tensor:
        """``kv_scales``: an FP8 cache's [2, kv_heads] K and V scales of this layer
        (``engine.kv_quant``), which ``ctx.calibrate_kv`` sets from this step's K and V."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        fused = getattr(self.kernels, "rope_and_cache", None)
        if fused is not None and self.q_norm is None and k_cache.is_contiguous() and kv_scales is None:
            heads = (self.num_heads, self.num_kv_heads)
            q, k, v = fused(qkv, cos, sin, k_cache, v_cache, ctx.slot_mapping, *heads)
        else:
            q, k, v = self._rope_and_cache(
                qkv, cos, sin, k_cache, v_cache, ctx.slot_mapping, kv_scales, ctx.calibrate_kv
            )
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.attn_meta, self.scale, kv_scales)
        return self.o_proj(o.view(T, self.q_size))

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
    """This rank's slice of the intermediate width (gate and up rows, down columns)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        self.inter = cfg.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, False, tp)
        self.kernels: Any = None  # with ``silu_mul``: the activation in one kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = getattr(self.kernels, "silu_mul", None)
        if fused is not None and gate_up.is_contiguous():
            return self.down_proj(fused(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, delta, cos, sin, k_cache, v_cache, ctx, kv_scales=None):
        """``x`` is the residual stream, still missing the previous layer's output
        ``delta``; returns this layer's output, to be added by the next norm."""
        attn = self.self_attn(self.input_layernorm(x, delta), cos, sin, k_cache, v_cache, ctx, kv_scales)
        return self.mlp(self.post_attention_layernorm(x, attn))


class StepContext:
    """What every layer needs about the current step, built once by the runner."""

    def __init__(
        self,
        slot_mapping: torch.Tensor,
        backend: AttentionBackend,
        attn_meta: Any,
        on_layer: Callable[[int], None] | None = None,
        calibrate_kv: bool = False,
    ):
        self.slot_mapping = slot_mapping
        self.backend = backend
        self.attn_meta = attn_meta
        self.on_layer = on_layer  # called with i once layer i wrote its KV
        self.calibrate_kv = calibrate_kv  # an FP8 cache takes its scales from this step's K and V


class LlamaModel(nn.Module):
    """The model as rank ``tp.rank`` of ``tp`` holds it (the whole model for TP=1).
    Parameters are left uninitialised: the loader fills them. Build it on the meta
    device and let the loader materialise it (``loader.build_model``), so that no
    memory is touched twice."""

    def __init__(self, cfg: ModelConfig, max_position: int, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        self.config = cfg
        self.max_position = max_position
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = VocabParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.linear.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_position)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]; KV written to the cache."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions, x.dtype)
        delta = None
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.layer(i)
            delta = layer(x, delta, cos, sin, k_cache, v_cache, ctx, kv_cache.layer_scales(i))
            if ctx.on_layer is not None:
                ctx.on_layer(i)
        return self.norm(x, delta)

    def use_kernels(self, kernels: Any) -> None:
        """Route the norms through a fused add+RMSNorm kernel (``add_rms_norm``), and
        attention and MLP through ``rope_and_cache`` / ``silu_mul`` where ``kernels``
        has them (not None: the Triton set on CUDA; the C++ set on CPU for bf16)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.kernels = kernels

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits in the model's dtype (the sampler upcasts what needs it)."""
        return self.lm_head(hidden)
