"""Building an engine's parts from its config: the model (loaded or random),
the tokenizer, the paged KV cache sized from the memory budget, the block
manager, scheduler, model runner and request validator. ``Engine`` (the
request lifecycle) holds what this returns."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.engine import kernels, kv_quant
from splitserve.engine.attention import AttentionBackend, get_backend
from splitserve.engine.attention.mla import MlaBackend
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.cuda_graphs import DecodeGraphs
from splitserve.engine.device import resolve_device, resolve_dtype
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_sizing import (
    KVCapacity,
    blocks_for,
    kv_budget_bytes,
    model_context,
    size_kv_cache,
)
from splitserve.engine.kv_tier import HostKVTier
from splitserve.engine.lora import LoRAAdapters
from splitserve.engine.model.checkpoint import checkpoint_bytes, safetensors_tensors
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.decoder import DecoderModel
from splitserve.engine.model.loader import build_model, load_hf_config, resolve_source
from splitserve.engine.model.parallel_fit import check_ep_compatible, check_tp_compatible
from splitserve.engine.model.revision import checkpoint_revision, random_revision, with_quantization
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.state_blocks import plan_states, state_views
from splitserve.engine.state_slots import StateSlots
from splitserve.engine.tokenizer import Tokenizer
from splitserve.wire.config import EngineConfig
from splitserve.wire.defaults import GenerationDefaults
from splitserve.wire.kv_layout import KVLayout, kv_head_range
from splitserve.wire.validation import RequestValidator

log = logging.getLogger(__name__)

# the models whose multi-token prediction layer the ``mtp`` method runs (``engine.model.mtp``:
# GLM-4.5's layer has DeepSeek-V3's form; DeepSeek-V3.2's is a V3.2 layer, indexer included)
MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm4_moe")
PROGRESS_BAR_BYTES = 2**30  # checkpoints this large show a progress bar per rank while loading


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    model_config: ModelConfig
    max_model_len: int
    capacity: KVCapacity
    model: torch.nn.Module
    tokenizer: Tokenizer | None
    eos_token_ids: set[int]
    kv_cache: KVCache
    block_manager: BlockManager
    host_tier: HostKVTier | None  # below the KV cache (config.host_kv_tier_mib), or none
    scheduler: Scheduler
    runner: ModelRunner
    validator: RequestValidator
    summary: str  # what was chosen (dtype, threads or device, attention, KV), for logs and status
    revision: str  # which weights it serves (engine.model.revision): part of the KV compatibility hash
    loras: LoRAAdapters | None = None  # its LoRA adapters (config.enable_lora)


def build_engine(config: EngineConfig, hf_config, tokenizer: Tokenizer | None, tp: TPGroup) -> EngineParts:
    """Load the model named by ``config`` (or build ``hf_config`` with random weights)
    as this rank's shard, and allocate the KV cache and the bookkeeping around it."""
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    source = None
    if hf_config is None:
        source = resolve_source(config.model)
        hf_config = load_hf_config(source)
    mc = ModelConfig.from_hf(hf_config)
    if config.runs_mtp and mc.model_type not in MTP_MODEL_TYPES:
        raise ValueError(
            f"speculative method mtp runs DeepSeek-V3's, V3.2's and GLM-4.5's multi-token prediction layers; "
            f"{mc.model_type}'s is not run yet (choose ngram or draft)"
        )
    if config.runs_mtp and not mc.num_mtp_layers:
        raise ValueError(
            f"speculative method mtp needs a model with a multi-token prediction layer (DeepSeek-V3's "
            f"or GLM-4.5's num_nextn_predict_layers); {mc.model_type} here has none"
        )
    # expert parallelism: the group splits the routed experts; every other layer is whole
    # on every rank (a group of one to shard by), attention data-parallel
    ep = tp if config.ep_size > 1 else None
    layer_tp = TPGroup.single() if ep is not None else tp
    check_ep_compatible(mc, config.ep_size, config.kv_cache_dtype)
    check_tp_compatible(mc, layer_tp.size)
    _check_hybrid(config, mc)
    context = model_context(config, mc.max_position_embeddings)  # lowered to what the KV holds below
    weights, progress = None, 0
    if not (config.random_weights or source is None):
        weights = safetensors_tensors(source.directory)
        size = checkpoint_bytes(source.directory)
        progress = size if size >= PROGRESS_BAR_BYTES else 0
        revision = checkpoint_revision(source.directory)
    else:
        revision = random_revision(hf_config.to_json_string(), config.seed)
    revision = with_quantization(revision, config.quantization)
    model = build_model(
        mc,
        dtype,
        device,
        context,
        weights,
        config.seed,
        config.native_kernels,
        config.quantization,
        layer_tp,
        progress_bytes=progress,
        ep=ep,
        mtp=config.runs_mtp,
    )
    loras = None
    if config.enable_lora:  # every targeted projection wrapped, then each adapter in a slot
        slots = config.num_lora_slots
        host = config.max_cpu_loras or slots
        loras = LoRAAdapters(model, mc, layer_tp, slots, host, config.max_lora_rank, dtype, device)
        for name, path in config.lora_modules.items():
            loras.load(name, path)
    tokenizer, defaults, eos_token_ids = _tokenizer_and_defaults(config, source, mc, tokenizer)
    fp8_kv = config.kv_cache_dtype == "fp8"
    layout = _kv_layout(config, mc, layer_tp, kv_quant.FP8 if fp8_kv else dtype)
    per_token = layout.bytes_per_token
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    # a hybrid model's states: the slots of the sequences that may hold some at once (and,
    # with prefix caching, as many snapshots: ``engine.state_slots``), out of the KV's
    # budget: max_num_seqs of them, or as many as half the budget holds
    budget = kv_budget_bytes(config, device.type, free)
    plan = plan_states(mc, layout, dtype) if mc.linear is not None else None
    slot_pool = None
    if plan is not None:
        per_sequence = (4 if config.enable_prefix_caching else 2) * plan.slot_bytes
        sequences = max(1, min(config.max_num_seqs, budget // 2 // per_sequence))
        slot_pool = StateSlots(sequences, sequences if config.enable_prefix_caching else 0)
    slots = slot_pool.total if slot_pool is not None else 0
    states = slots * plan.slot_bytes if plan is not None else 0
    budget -= states
    if slots and budget < per_token * config.block_size and config.num_kv_blocks is None:
        raise ValueError(
            f"the linear layers' states of one sequence ({slots} slots) take {states / 2**20:.0f} MiB, "
            "all the KV cache's memory: give the cache more"
        )
    num_blocks = blocks_for(config, budget, per_token)
    num_blocks = tp.min_int(num_blocks)  # every rank the same block ids
    backend, use_graphs = _attention(config, mc, device, tp.size)
    use_graphs = use_graphs and mc.linear is None  # a hybrid step's states are not captured
    use_graphs = use_graphs and not layout.grouped  # a graph replays one block table per row
    # a CUDA graph's padding rows write to the last block: requests get the others
    usable = num_blocks - 1 if use_graphs else num_blocks
    window = max(layout.windows, default=0)
    capacity = size_kv_cache(config, usable, per_token, context, _window_blocks(config, layout, usable))
    max_model_len = capacity.max_model_len
    if plan is None:
        kv_cache = KVCache(dataclasses.replace(layout, num_blocks=num_blocks), device)
    else:  # the slots' blocks past the KV ones (``engine.state_blocks``)
        total = num_blocks + slots * plan.blocks_per_slot
        kv_cache = KVCache(dataclasses.replace(layout, num_blocks=total, states=plan.signature()), device)
        kv_cache.states = state_views(kv_cache.tensor, plan, mc, num_blocks, slots, dtype)
        kv_cache.state_plan, kv_cache.kv_blocks = plan, num_blocks
    graphs = None
    if use_graphs:
        _experts_for_graphs(model)
        # a verification step's draft tokens are decode rows too (``ModelRunner.spread_drafts``)
        drafts = config.speculative.num_tokens if config.speculative is not None else 0
        rows = config.max_num_seqs * (1 + drafts)
        graphs = DecodeGraphs.for_engine(model, kv_cache, backend, rows, max_model_len, tp.size, loras)
    # one shard of blocks per rank of an expert-parallel group (each rank caches its own sequences)
    shards = config.ep_size
    tier = None
    if config.host_kv_tier_mib:
        tier = HostKVTier.of_size(kv_cache, config.host_kv_tier_mib)
    block_manager = BlockManager(
        capacity.num_blocks * shards,
        config.block_size,
        config.enable_prefix_caching,
        shards,
        tier,
        slot_pool,
        window,
        layout.window_groups,
    )
    scheduler = Scheduler(block_manager, config.max_num_batched_tokens, config.max_num_seqs)
    native = kernels.load() if config.native_kernels and device.type == "cpu" else None
    runner = ModelRunner(
        model,
        kv_cache,
        backend,
        Sampler(config.seed, native.argmax_rows if native is not None else None, eos_token_ids),
        device,
        tp,
        graphs,
        data_parallel=ep is not None,
        loras=loras,
    )
    if kv_cache.scales is not None:
        set_kv_scales(runner, mc, source.directory if weights is not None else None, config.seed)
    validator = RequestValidator(
        model=config.model,
        vocab_size=mc.vocab_size,
        max_model_len=max_model_len,
        max_kv_tokens=capacity.num_tokens,
        tokenizer=tokenizer,
        defaults=defaults,
    )
    summary = _summary(config, mc, dtype, device, tp, ep is not None, runner.backend.name, capacity, tier)
    if slot_pool is not None:
        summary += (
            f"; linear-layer states of {sequences} sequences at once ({states / 2**20:.0f} MiB"
            f"{', with prefix snapshots' if slot_pool.snapshots else ''})"
        )
    log.info("engine ready (TP rank %d), revision %s: %s", tp.rank, revision, summary)
    return EngineParts(
        summary=summary,
        revision=revision,
        device=device,
        dtype=dtype,
        model_config=mc,
        max_model_len=max_model_len,
        capacity=capacity,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        kv_cache=kv_cache,
        block_manager=block_manager,
        host_tier=tier,
        scheduler=scheduler,
        runner=runner,
        validator=validator,
        loras=loras,
    )


def _tokenizer_and_defaults(
    config: EngineConfig, source, mc: ModelConfig, tokenizer: Tokenizer | None
) -> tuple[Tokenizer | None, GenerationDefaults, set[int]]:
    """The tokenizer (the one given, the config's, or the checkpoint's), the checkpoint's
    generation defaults (when asked), and every token id that ends a sequence."""
    if tokenizer is None and config.tokenizer:
        tokenizer = Tokenizer.from_source(config.tokenizer)
    elif tokenizer is None and source is not None and source.has_tokenizer:
        tokenizer = Tokenizer.from_source(str(source.directory))
    defaults = GenerationDefaults()
    if config.generation_config and source is not None:
        defaults = GenerationDefaults.read(source.directory)
    eos_token_ids = set(mc.eos_token_ids) | set(defaults.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_token_ids.add(tokenizer.eos_token_id)
    return tokenizer, defaults, eos_token_ids


def _kv_layout(config: EngineConfig, mc: ModelConfig, layer_tp: TPGroup, kv_dtype: torch.dtype) -> KVLayout:
    """This rank's KV cache layout (its KV heads; the block count is set once sized),
    the MTP layer's one more layer where it runs (``engine.model.mtp``), each layer's
    sliding window where the model has them."""
    k0, k1 = kv_head_range(mc.num_kv_heads, layer_tp.size, layer_tp.rank)
    windows = tuple(mc.window(i) or 0 for i in mc.kv_layers) + ((0,) if config.runs_mtp else ())
    return KVLayout(
        len(mc.kv_layers) + (1 if config.runs_mtp else 0),
        0,
        config.block_size,
        k1 - k0,
        mc.head_dim,
        str(kv_dtype).removeprefix("torch."),
        tp_size=layer_tp.size,
        tp_rank=layer_tp.rank,
        model_kv_heads=mc.num_kv_heads,
        kv_scales=kv_quant.SCHEME if config.kv_cache_dtype == "fp8" else "none",
        planes=mc.kv_planes,
        windows=windows if any(windows) else (),
        grouped=_groups_layers(config, windows),
    )


def _groups_layers(config: EngineConfig, windows: tuple[int, ...]) -> bool:
    """Whether the cache holds sliding and full layers in layer groups, the sliding ones
    holding their window only (``KVLayout.grouped``): for a model with both, unless
    ``kv_layer_groups`` is off. ``ValueError`` for what does not keep layer groups yet
    (a host KV tier, ``self`` speculation): the sentence says how to run it."""
    if not (config.kv_layer_groups and any(windows) and not all(windows)):
        return False
    off = "set kv_layer_groups false (the model section) to keep every layer's whole sequence and run it"
    if config.host_kv_tier_mib:
        raise ValueError(
            f"host_kv_tier_mib: a host tier does not keep a sliding-window model's layer groups; {off}"
        )
    if config.speculative is not None and config.speculative.method == "self":
        raise ValueError(
            f"speculative method self does not run over a sliding-window model's layer groups; {off}"
        )
    return True


def _window_blocks(config: EngineConfig, layout: KVLayout, usable: int) -> int:
    """Of ``usable`` blocks, those the longest request's sliding layer groups may hold
    beside its full layers' (``KVLayout.grouped``; 0 without them): each group its
    blocks up to a step's tokens and its window (and one), or as many as the full ones."""
    k = layout.window_groups
    if not k:
        return 0
    reach = -(-(config.max_num_batched_tokens + max(layout.windows)) // config.block_size) + 1
    full = usable // (1 + k) if usable <= (1 + k) * reach else usable - k * reach
    return usable - full


def _check_hybrid(config: EngineConfig, mc: ModelConfig) -> None:
    """``ValueError`` for what a hybrid model (linear-attention layers) does not run with
    yet: speculative decoding but n-gram's (a draft model or the target's own layers
    would need states of their own), an FP8 KV cache (the states share it), a host KV
    tier (it holds cached prefixes, and a hybrid model caches none)."""
    if mc.linear is None:
        return
    if config.speculative is not None and config.speculative.method != "ngram":
        raise ValueError(
            f"speculative method {config.speculative.method} does not run with {mc.model_type} yet "
            "(its draft would need the linear layers' states too): choose ngram"
        )
    if config.kv_cache_dtype == "fp8":
        raise ValueError(
            f"kv_cache_dtype fp8 does not run with {mc.model_type} yet (its states share the cache)"
        )
    if config.host_kv_tier_mib:
        raise ValueError(f"host_kv_tier_mib: a host tier does not keep {mc.model_type}'s state snapshots yet")


def _attention(
    config: EngineConfig, mc: ModelConfig, device: torch.device, tp_size: int
) -> tuple[AttentionBackend, bool]:
    """The attention backend, and whether decode runs in CUDA graphs; ``ValueError`` for
    a combination that does not run (MLA with CUDA graphs, an FP8 KV cache on a
    backend that cannot read it, MLA with an FP8 KV cache, sliding windows or sinks on
    a backend without them). ``auto`` with an FP8 cache
    is the Triton kernel on CUDA (it reads e4m3 in place; graphs capture it) and SDPA
    on CPU."""
    fp8_kv = config.kv_cache_dtype == "fp8"
    if mc.mla is not None and fp8_kv:
        raise ValueError(f"{mc.model_type} (MLA) does not run with kv_cache_dtype fp8 yet")
    if mc.mla is not None and config.cuda_graphs:  # its attention reads sizes on the host
        raise ValueError(f"{mc.model_type} (MLA) does not run with cuda_graphs yet")
    attention = config.attention_backend
    if fp8_kv and attention == "auto":
        attention = "triton" if device.type == "cuda" else "sdpa"
    windows = mc.attn_sinks or mc.sliding_window is not None or mc.attn_softcap is not None
    if windows and attention == "auto" and device.type == "cuda":
        attention = "triton"  # its kernel has windows, sinks and soft caps; flash-attn's backend not yet
    if mc.mla is not None:
        backend: AttentionBackend = MlaBackend(mc.mla.kv_lora_rank)
    else:
        backend = get_backend(attention, device, config.native_kernels)
    if windows and not backend.windows_and_sinks:
        raise ValueError(
            f"{mc.model_type}'s sliding windows, attention sinks and soft-capped logits run on the sdpa "
            f"and cpu attention backends; {backend.name} has none of them yet"
        )
    if fp8_kv and not backend.reads_fp8_kv:
        raise ValueError(
            f"kv_cache_dtype fp8 runs on the sdpa and triton attention backends; {backend.name} cannot"
            " read it"
        )
    use_graphs = config.cuda_graphs
    if use_graphs is None:  # not with LoRA: a graph replays no step's adapters (config refuses True)
        # MoE layers only when asked (``cuda_graphs: true``) until a GPU has replayed their
        # kernels (tests/gpu); then they join this default
        use_graphs = (
            (device.type == "cuda" and backend.name == "triton" and tp_size == 1 and mc.mla is None)
            and mc.moe is None
            and not config.enable_lora
        )
    return backend, use_graphs


def _experts_for_graphs(model: DecoderModel) -> None:
    """Routed experts in a recorded decode step run ``triton_moe.fused_experts`` (the
    torch loop reads each expert's row count on the host, which a capture refuses):
    on CUDA the Triton set already chose it; elsewhere it is Triton's interpreter,
    which the triton attention backend that graphs need also runs on."""
    layers = model.moe_layers()
    if layers and any(m.grouped_kernel is None for m in layers):
        from splitserve.engine.kernels.triton_moe import fused_experts

        for m in layers:
            m.grouped_kernel = fused_experts


def draft_attention(config: EngineConfig, mc: ModelConfig, device: torch.device) -> AttentionBackend:
    """The attention backend of a draft's cache over ``mc``'s layers (the model's dtype,
    no FP8, no CUDA graphs): the one ``config`` would pick for them otherwise."""
    plain = dataclasses.replace(config, kv_cache_dtype="auto", cuda_graphs=False, speculative=None)
    return _attention(plain, mc, device, 1)[0]


def _summary(
    config: EngineConfig,
    mc: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup,
    ep: bool,
    attention: str,
    capacity: KVCapacity,
    tier: HostKVTier | None,
) -> str:
    """What was chosen (dtype, threads or device, attention, KV), for logs and status."""
    threads = f"{torch.get_num_threads()} torch threads" if device.type == "cpu" else str(device)
    return (
        f"{mc.model_type}, {str(dtype).removeprefix('torch.')}"
        f"{', fp8 KV cache' if config.kv_cache_dtype == 'fp8' else ''}"
        f"{'' if config.quantization == 'none' else f' with {config.quantization} linears'} on {threads}"
        f"{f' (TP {tp.size})' if tp.size > 1 and not ep else ''}"
        f"{f' (EP {tp.size}: {mc.moe.num_experts // tp.size} experts per rank)' if ep else ''}"
        f", attention {attention}{' data-parallel' if ep else ''}, "
        f"up to {config.max_num_seqs} sequences; {capacity.describe()}"
        f"{f'; host KV tier of {tier.capacity} blocks' if tier is not None else ''}"
    )


CALIBRATION_TOKENS = 256  # the prompt an FP8 KV cache's scales are calibrated on, at most


def set_kv_scales(runner: ModelRunner, mc: ModelConfig, checkpoint: Path | None, seed: int) -> None:
    """An FP8 cache's scales: the ``checkpoint``'s ``k_scale`` / ``v_scale`` where it ships
    them, else calibrated on a prompt of pseudo-random tokens (the same on every rank
    and every worker of a model; ``engine.kv_quant`` says how)."""
    scales = runner.kv_cache.scales
    shipped = checkpoint_kv_scales(checkpoint, mc.num_layers) if checkpoint is not None else None
    if shipped is not None:
        scales.copy_(shipped[:, :, None].expand_as(scales))
        return
    cache_tokens = runner.kv_cache.layout.num_blocks * runner.kv_cache.layout.block_size
    n = max(1, min(CALIBRATION_TOKENS, cache_tokens, runner.model.max_position))
    rng = torch.Generator().manual_seed(seed)
    runner.calibrate_kv(torch.randint(0, mc.vocab_size, (n,), generator=rng).tolist())


def checkpoint_kv_scales(directory: Path, num_layers: int) -> torch.Tensor | None:
    """[num_layers, 2]: the checkpoint's per-layer K and V scales (FP8 checkpoints with a
    KV cache scheme ship ``model.layers.N.self_attn.k_scale`` / ``v_scale``), or None
    unless every layer has both."""
    found: dict[str, float] = {}
    for name, tensor in safetensors_tensors(directory):
        if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):
            found[name] = float(tensor.read().float().max())
    rows = []
    for i in range(num_layers):
        k, v = (found.get(f"model.layers.{i}.self_attn.{x}_scale") for x in "kv")
        if k is None or v is None:
            return None
        rows.append((k, v))
    return torch.tensor(rows, dtype=torch.float32)
