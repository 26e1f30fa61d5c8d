"""Tiny random-weight models of every family the engine runs, saved as Hugging
Face checkpoints: what the tests compare against transformers, and what the
device check (``bench.device_check``) hands over between processes. Needs
transformers (a test dependency; present on the GPU image)."""

from __future__ import annotations

import copy

import torch


def tiny_hf_config(kind: str, vocab_size: int = 512, max_position: int = 1024, kv_heads: int = 2):
    """A small config of the given family (llama; llama3, with rope scaling; mistral;
    qwen2, with q/k/v biases; qwen3, with q/k norms): 4 query heads over ``kv_heads``.
    Mixture-of-experts families: mixtral (4 experts, top 2); qwen3_moe (8 experts,
    top 2 renormalised, layer 0 dense); qwen2_moe (8 experts, top 2 not renormalised,
    a gated shared expert); deepseek_v3 (MLA with a q bottleneck, 8 experts in 4
    groups of which 2 are searched, sigmoid routing with correction bias and scaling,
    a shared expert, layer 0 dense); deepseek_v32 (deepseek_v3 with an indexer of 16
    heads keeping 8 tokens a query: with 4, a token all of whose heads score <= 0 has
    index score exactly 0 after the ReLU, and 24 of 900 queries of the tests' prompts
    tied at the 8th place, which transformers' topk and the engine's break
    differently; with 16, none did); gemma3_text (6 layers, 2 sliding (window 16) to
    1 full, twice, a RoPE per kind, q/k norms, soft-capped logits); gemma2 (4 layers
    alternating sliding (window 16) and full, attention logits soft-capped at 2, final
    ones at 30); glm4_moe
    (DeepSeek-V3's routing in 2 groups of 4, q/k norms and biases, RoPE over half of
    each 32-dim head, layer 0 dense); qwen3_next and qwen3_5_text (hybrid: 3 Gated
    DeltaNet layers of 2 key / 4 value heads, then a gated full-attention layer with
    RoPE over a quarter of each 16-dim head; Qwen3-Next's MoE of 8 experts top 2 with a
    gated shared expert, layer 1 dense; Qwen3.5 dense); gpt_oss (4 layers
    alternating sliding (window 16) and full attention, attention sinks, q/k/v/o
    biases, YaRN, 4 experts top 2 with biases and the clamped SwiGLU)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama3":
        return LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            rope_theta=500000.0,
            tie_word_embeddings=True,
        )
    if kind == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False)
    if kind == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)
    if kind == "gemma3_text":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6},
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=16,
            layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        )
    if kind == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(
            **{**common, "num_hidden_layers": 4},
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_logit_softcapping=2.0,  # released: 50; here small enough to bite on random weights
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        )
    return _tiny_moe_config(kind, common)


def _tiny_moe_config(kind: str, common: dict):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if kind == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    moe = dict(moe_intermediate_size=32, num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, **moe, head_dim=32, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0]
        )
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(
            **common, **moe, num_experts=8, norm_topk_prob=False, shared_expert_intermediate_size=64
        )
    if kind in ("deepseek_v3", "deepseek_v32"):
        from transformers import DeepseekV32Config

        mha = {**common, "num_key_value_heads": common["num_attention_heads"]}  # MLA keys are per head
        if kind == "deepseek_v32":  # V3 with the sparse attention's indexer: 8 tokens kept a query
            cls, index = DeepseekV32Config, {"index_topk": 8, "index_n_heads": 16, "index_head_dim": 16}
            index["num_nextn_predict_layers"] = 1  # as released (V3's config has it by default)
        else:
            cls, index = DeepseekV3Config, {}
        return cls(
            **mha,
            **index,
            **moe,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        )
    if kind == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(
            **common,
            **moe,
            head_dim=32,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
            num_nextn_predict_layers=1,  # as released: the MTP layer (when written) is layer 2
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    if kind in ("qwen3_next", "qwen3_5_text"):
        hybrid = dict(
            **{**common, "num_hidden_layers": 4},
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            tie_word_embeddings=False,
        )
        if kind == "qwen3_5_text":
            from transformers import Qwen3_5TextConfig

            return Qwen3_5TextConfig(**hybrid)
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            **hybrid,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    if kind == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(
            **{**common, "num_hidden_layers": 4, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": common["max_position_embeddings"] // 4,
                "rope_theta": 150000.0,
            },
            tie_word_embeddings=False,
        )
    raise ValueError(kind)


# families whose norms scale by 1 + weight (weights 0 at init)
UNIT_NORMS = ("gemma2", "gemma3_text", "qwen3_next", "qwen3_5_text")


def make_hf_checkpoint(
    kind: str,
    directory,
    seed: int = 0,
    kv_heads: int = 2,
    max_position: int = 1024,
    mtp: bool = False,
    **config: object,
):
    """A random-weight HF model of ``kind``, saved as safetensors into ``directory``;
    with ``mtp`` (deepseek_v3, deepseek_v32, glm4_moe) also a multi-token prediction layer
    (``add_mtp_layer``), which transformers does not run: the returned model then
    carries what ``add_mtp_layer`` returned as ``mtp_layer``, for a test's reference.
    ``config``: attributes set on ``tiny_hf_config``'s config (another layer mix, window)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = tiny_hf_config(kind, kv_heads=kv_heads, max_position=max_position)
    for name, value in config.items():
        setattr(hf_config, name, value)
    config = hf_config
    # transformers runs sinks and soft-capped attention logits eagerly only
    capped = getattr(config, "attn_logit_softcapping", None) is not None
    attention = "eager" if kind == "gpt_oss" or capped else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    # Larger weights than the default init make logits less flat, so greedy ties are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and stacked experts
                p.normal_(0, 0.2)
            elif kind == "gpt_oss" and name.endswith(("bias", "sinks")):  # ~0 at init: make them count
                p.normal_(0, 0.5)
            elif kind in ("gemma2", "gemma3_text", "qwen3_next", "qwen3_5_text") and name.endswith(
                "norm.weight"
            ):
                p.normal_(0, 0.5)  # 0 at init (1 + w; a gated norm's 1): make them count
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make it choose
                b.uniform_(0, 0.5)
    model.save_pretrained(str(directory))
    if mtp:
        model.mtp_layer = add_mtp_layer(model, directory)
    return model


MTP_FILE = "model-mtp.safetensors"


def add_mtp_layer(model, directory):
    """Write a random multi-token prediction layer for ``model`` (a transformers
    DeepSeek-V3, V3.2 or GLM-4.5 model: GLM-4.5's has DeepSeek-V3's form) into
    ``directory/MTP_FILE``, named as the released checkpoints name it
    (``model.layers.{num_hidden_layers}.*``: an ordinary layer's tensors, ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head.norm``, and copies of the embedding and LM
    head). Returns (the layer as the model's own transformers decoder layer, {enorm,
    hnorm, eh_proj, norm: its other tensors})."""
    from safetensors.torch import save_file

    config, h = model.config, model.config.hidden_size
    if config.model_type == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer as Layer
    elif config.model_type == "deepseek_v32":
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer as Layer
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer as Layer
    index = config.num_hidden_layers
    if getattr(config, "mlp_layer_types", None):  # V3.2's config lists its layers: the MTP one is MoE
        config = copy.deepcopy(config)
        config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
    layer = Layer(config, index).eval()
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
        for name, b in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(0, 0.5)
    extra = {n: 1 + 0.1 * torch.randn(h) for n in ("enorm", "hnorm", "norm")}
    extra["eh_proj"] = 0.2 * torch.randn(h, 2 * h)
    p = f"model.layers.{index}."
    tensors = {p + k: v.detach().clone() for k, v in layer.state_dict().items()}
    tensors.update({f"{p}{n}.weight": extra[n] for n in ("enorm", "hnorm", "eh_proj")})
    tensors[p + "shared_head.norm.weight"] = extra["norm"]
    tensors[p + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    tensors[p + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file(_per_expert(tensors), f"{directory}/{MTP_FILE}")
    return layer, extra


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) as a checkpoint names them, one per expert."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def make_mxfp4_gpt_oss(directory, seed: int = 0):
    """A tiny gpt-oss checkpoint laid out as the released ones are: each layer's two
    expert weight stacks in MXFP4 (``*_blocks`` [E, rows, groups, 16] uint8 codes and
    ``*_scales`` [E, rows, groups] E8M0 exponents, random), ``quantization_config``
    ``mxfp4``; the rest as ``make_hf_checkpoint`` writes it. Returns the transformers
    model holding the stacks as transformers itself dequantises them (its
    ``convert_moe_packed_tensors``): the reference."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory = Path(directory)
    model = make_hf_checkpoint("gpt_oss", directory, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    tensors = load_file(directory / "model.safetensors")
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for stack in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, stack)  # [E, inputs, outputs]
                e, inputs, outputs = param.shape
                blocks = torch.randint(0, 256, (e, outputs, inputs // 32, 16), generator=g, dtype=torch.uint8)
                scales = torch.randint(121, 124, (e, outputs, inputs // 32), generator=g, dtype=torch.uint8)
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                name = f"model.layers.{i}.mlp.experts.{stack}"
                del tensors[name]
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (directory / "config.json").write_text(json.dumps(config))
    return model
