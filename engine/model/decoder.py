"""The decoder every family is built as, written for packed variable-length batches
over a paged KV cache, each rank of a tensor-parallel group building only its shard
(``splitserve.engine.parallel.layers``).

A layer is attention then MLP, each behind an RMSNorm on the residual stream
(Gemma 3: each also followed by one, ``sandwich_norms``); which kinds,
``ModelConfig`` says, layer by layer::

    attention   GQA (``llama.Attention``)       or  MLA (``mla.MLAttention``: DeepSeek-V3)
                                                or  Gated DeltaNet (``deltanet``: a hybrid
                                                    model's linear layers; their state in
                                                    ``KVCache.states``, no KV)
    MLP         dense (``llama.MLP``)           or  mixture of experts (``moe.SparseMoE``)
                                                    except the layers ``moe.dense_layers`` names

Input is one flat batch of ``T`` tokens from many sequences (no padding); the
attention backend knows where each sequence starts and which cache blocks hold
its past. Parameter names follow Hugging Face checkpoints (``engine.model.placement``
maps each checkpoint tensor to this rank's slice of one).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.deltanet import GatedDeltaNet, delta_shape
from splitserve.engine.model.llama import MLP, Attention, RMSNorm, StepContext
from splitserve.engine.model.mla import MLAttention
from splitserve.engine.model.moe import SparseMoE
from splitserve.engine.model.mtp import MTPLayer
from splitserve.engine.model.rope import RotaryEmbedding
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.layers import VocabParallelEmbedding, VocabParallelLMHead


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup | None = None, ep: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        h, eps, unit = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(h, eps, unit)
        self.self_attn = self.linear_attn = None
        if cfg.is_linear(index):
            self.linear_attn = GatedDeltaNet(delta_shape(cfg, tp.size), cfg.linear.fused, tp)
        else:
            self.self_attn = MLAttention(cfg, tp) if cfg.mla is not None else Attention(cfg, tp, index)
        self.post_attention_layernorm = RMSNorm(h, eps, unit)
        self.mlp = SparseMoE(cfg, tp, ep) if cfg.is_moe_layer(index) else MLP(cfg, tp)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if cfg.sandwich_norms:  # post_attention_layernorm then normalises attention's output
            self.pre_feedforward_layernorm = RMSNorm(h, eps, unit)
            self.post_feedforward_layernorm = RMSNorm(h, eps, unit)

    def forward(self, x, delta, cos, sin, k_cache, v_cache, ctx, kv_scales=None, states=None):
        """``x`` is the residual stream, still missing the previous layer's output
        ``delta``; returns this layer's output, to be added by the next norm. A
        linear-attention layer reads and writes ``states`` (its ``DeltaStates``) for
        ``ctx.delta_spans`` instead of a KV cache."""
        normed = self.input_layernorm(x, delta)
        if self.linear_attn is not None:
            attn = self.linear_attn(normed, ctx.delta_spans, states)
        else:
            attn = self.self_attn(normed, cos, sin, k_cache, v_cache, ctx, kv_scales)
        if self.pre_feedforward_layernorm is None:
            return self.mlp(self.post_attention_layernorm(x, attn))
        mlp = self.mlp(self.pre_feedforward_layernorm(x, self.post_attention_layernorm(attn)))
        return self.post_feedforward_layernorm(mlp)


class DecoderModel(nn.Module):
    """The model as rank ``tp.rank`` of ``tp`` holds it (the whole model for TP=1);
    with ``ep`` (expert parallelism) every rank holds all but the routed experts
    whole, and its share of those (``moe.SparseMoE``). Parameters are left
    uninitialised: the loader fills them. Build it on the meta device and let the
    loader materialise it (``loader.build_model``), so that no memory is touched twice."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_position: int,
        tp: TPGroup | None = None,
        ep: TPGroup | None = None,
        mtp: bool = False,
    ):
        """``mtp``: also build the checkpoint's multi-token prediction layer
        (``engine.model.mtp``; ``cfg.num_mtp_layers`` >= 1), run by ``predict_next``."""
        super().__init__()
        tp = tp or TPGroup.single()
        self.config = cfg
        self.max_position = max_position
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, ep) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = VocabParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.linear.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope_dim, cfg.rope, max_position)
        # the sliding layers' own RoPE (Gemma 3's local base), where they have one
        self.local_rotary = None
        if cfg.rope_local is not None:
            self.local_rotary = RotaryEmbedding(cfg.rope_dim, cfg.rope_local, max_position)
        # per layer: whether it turns with ``local_rotary`` (a sliding layer, where there is one)
        self._local = tuple(
            self.local_rotary is not None and cfg.window(i) is not None for i in range(cfg.num_layers)
        )
        self.mtp = MTPLayer(cfg, DecoderLayer(cfg, cfg.num_layers, tp, ep)) if mtp else None
        # per layer: its layer of the KV cache, or its row of ``KVCache.states`` (linear layers)
        linear = [i for i in range(cfg.num_layers) if cfg.is_linear(i)]
        self._cache_index = tuple(
            linear.index(i) if cfg.is_linear(i) else cfg.kv_layers.index(i) for i in range(cfg.num_layers)
        )

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, kv_cache: KVCache, ctx: StepContext, num_layers: int | None = None
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]; KV written to the cache.
        With no tokens (a rank of an expert-parallel group none of whose sequences run
        this step) only the MoE layers run, to take part in the group's exchanges.
        ``num_layers``: run only the first that many layers (an early exit: the
        self-speculation draft, ``engine.speculative.draft``), with a cache of as many."""
        if input_ids.numel() == 0:
            return self._no_tokens()
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the model's dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        tables = self.rotary.tables(positions, x.dtype)
        local = None if self.local_rotary is None else self.local_rotary.tables(positions, x.dtype)
        delta = None
        for i, layer in enumerate(itertools.islice(self.layers, num_layers)):  # no new ModuleList
            c = self._cache_index[i]
            if layer.linear_attn is not None:
                delta = layer(x, delta, None, None, None, None, ctx, states=kv_cache.states[c])
                continue
            k_cache, v_cache = kv_cache.layer(c)
            cos, sin = local if self._local[i] else tables
            # layer groups: the layer's group's slots and tables (``StepContext.of``)
            layer_ctx = ctx if ctx.groups is None else ctx.of(kv_cache.layout.group(c))
            delta = layer(x, delta, cos, sin, k_cache, v_cache, layer_ctx, kv_cache.layer_scales(c))
            if ctx.on_layer is not None:
                ctx.on_layer(c)
        return self.norm(x, delta)

    @torch.inference_mode()
    def predict_next(self, next_ids, positions, hidden, kv_cache: KVCache, ctx: StepContext) -> torch.Tensor:
        """The MTP layer (``engine.model.mtp``) over a step the target just ran: row i
        from ``hidden`` (``forward``'s row i) and ``next_ids[i]`` (the token after
        row i's); its KV written to the cache's last layer at ``ctx``'s slots. Returns
        the states whose logits (``compute_logits``) predict the token after that."""
        cos, sin = self.rotary.tables(positions, hidden.dtype)
        layer = self.config.num_layers
        out = self.mtp(self.embed_tokens(next_ids), hidden, cos, sin, kv_cache.layer(layer), ctx)
        if ctx.on_layer is not None:
            ctx.on_layer(layer)
        return out

    def _no_tokens(self) -> torch.Tensor:
        empty = self.norm.weight.new_empty((0, self.config.hidden_size))
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp(empty)
        return empty

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def use_kernels(self, kernels: Any) -> None:
        """Route the norms through a fused add+RMSNorm kernel (``add_rms_norm``), and
        GQA attention and dense MLPs through ``rope_and_cache`` / ``silu_mul``, and the
        routed experts through ``fused_experts``, where ``kernels`` has them (not
        None: the Triton set on CUDA; the C++ set on CPU for bf16); with the Triton set,
        FP8 activations straight from the norms and SiLU·up (``_fp8_activations``)."""
        for m in self.modules():
            if isinstance(m, RMSNorm) and m.unit_offset:
                continue  # Gemma's norm: no kernel runs it
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.kernels = kernels
            elif isinstance(m, SparseMoE):
                m.grouped_kernel = getattr(kernels, "fused_experts", None)
        if hasattr(kernels, "add_rms_norm_fp8"):
            self._fp8_activations()

    def _fp8_activations(self) -> None:
        """Where an FP8 linear takes its input quantized (``fp8_input_group``), have the
        norm or SiLU·up before it emit FP8 in that grouping: a layer's input norm for
        ``qkv_proj``, its post-attention norm for a dense MLP's ``gate_up_proj``, and
        every MLP (shared experts too) for its ``down_proj``."""

        def group(linear: nn.Module) -> int | None:
            return getattr(linear, "fp8_input_group", None)

        for layer in self.layers:
            if isinstance(layer.self_attn, Attention):
                layer.input_layernorm.fp8_group = group(layer.self_attn.qkv_proj)
            if isinstance(layer.mlp, MLP):
                layer.post_attention_layernorm.fp8_group = group(layer.mlp.gate_up_proj)
        for m in self.modules():
            if isinstance(m, MLP):
                m.fp8_group = group(m.down_proj.linear)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits in the model's dtype (the sampler upcasts what needs it),
        soft-capped (``cap * tanh(logits / cap)``) where the model asks."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
