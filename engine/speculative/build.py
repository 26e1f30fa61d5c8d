"""Building a proposer for an engine: the n-gram lookup, a model proposer with its
draft model, KV cache and runner (``speculative.draft``), or the MTP layer's
(``speculative.mtp``). Each is imported only when chosen."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.speculative import Proposer
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.kv_layout import KVLayout

if TYPE_CHECKING:  # the proposers' own modules bring torch
    import torch

    from splitserve.engine.model.config import ModelConfig
    from splitserve.engine.model_runner import ModelRunner


@dataclass(frozen=True)
class Target:
    """What a proposer is built against: the target engine as built (driver rank)."""

    config: EngineConfig
    model: torch.nn.Module
    model_config: ModelConfig
    kv_layout: KVLayout  # the target cache's (a self-speculation draft's is its first layers)
    kv_tokens: int  # tokens the target's cache holds
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    runner: ModelRunner  # the target's (an MTP proposer reads its predictions)

    @classmethod
    def of_engine(cls, engine) -> Target:
        """The target an ``Engine`` (built, its driver rank) is."""
        e = engine
        layout, tokens = e.kv_cache.layout, e.capacity.num_tokens
        return cls(
            e.config, e.model, e.model_config, layout, tokens, e.max_model_len, e.device, e.dtype, e.runner
        )


def build_proposer(spec: SpeculativeConfig, target: Target) -> Proposer:
    """The proposer ``spec.method`` names; ``ValueError`` with a sentence for a
    combination that cannot run."""
    if spec.method == "ngram":
        from splitserve.engine.speculative.ngram import NgramProposer

        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.method == "self":
        return _self_proposer(spec, target)
    if spec.method == "draft":
        return _draft_proposer(spec, target)
    if spec.method == "mtp":
        from splitserve.engine.speculative.mtp import MTPProposer

        if target.runner.model.mtp is None:
            raise ValueError("speculative method mtp needs the engine built with its MTP layer")
        return MTPProposer(target.runner)
    raise ValueError(f"no speculative proposer {spec.method!r}")


def _blocks(spec: SpeculativeConfig, target: Target) -> int:
    from splitserve.engine.speculative.draft import draft_blocks

    c = target.config
    return draft_blocks(target.kv_tokens, c.max_num_seqs, c.block_size, spec.num_tokens)


def _self_proposer(spec: SpeculativeConfig, target: Target) -> Proposer:
    from splitserve.engine.build import draft_attention
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.sampler import Sampler
    from splitserve.engine.speculative.draft import EarlyExit, ModelProposer

    layers = target.model_config.num_layers
    if not spec.draft_layers < layers:
        raise ValueError(
            f"speculative draft_layers ({spec.draft_layers}) must be below the target's {layers} layers"
        )
    if target.config.group_size > 1:
        raise ValueError("self-speculation runs on engines without tensor or expert parallelism")
    layout = dataclasses.replace(
        target.kv_layout,
        num_layers=spec.draft_layers,
        windows=target.kv_layout.windows[: spec.draft_layers],
        num_blocks=_blocks(spec, target),
        dtype=str(target.dtype).removeprefix("torch."),
        kv_scales="none",
    )
    cache = KVCache(layout, target.device)
    backend = draft_attention(target.config, target.model_config, target.device)
    model = EarlyExit(target.model, spec.draft_layers)
    # the target's projections, LoRA adapters and all: each draft row runs under its request's
    runner = ModelRunner(
        model, cache, backend, Sampler(target.config.seed), target.device, loras=target.runner.loras
    )
    # the target's first layers hold the draft's KV of every computed token (an FP8 target
    # cache does not hold it in the draft's dtype: the draft recomputes it then)
    shared = target.runner.kv_cache if target.runner.kv_cache.layout.dtype == layout.dtype else None
    return ModelProposer("self", runner, target.model_config.vocab_size, target.max_model_len, shared)


def _draft_proposer(spec: SpeculativeConfig, target: Target) -> Proposer:
    from splitserve.engine.build import build_engine
    from splitserve.engine.parallel.group import TPGroup
    from splitserve.engine.speculative.draft import ModelProposer

    c = target.config
    config = EngineConfig(
        model=spec.draft_model,
        dtype=str(target.dtype).removeprefix("torch."),
        device=str(target.device),
        block_size=c.block_size,
        num_kv_blocks=_blocks(spec, target),
        max_model_len=target.max_model_len,
        enable_prefix_caching=False,
        attention_backend=c.attention_backend,
        native_kernels=c.native_kernels,
        cuda_graphs=False,
        seed=c.seed,
        generation_config=False,
        kv_layer_groups=False,  # its proposer drives one table per sequence
    )
    parts = build_engine(config, None, None, TPGroup.single())
    return ModelProposer("draft", parts.runner, target.model_config.vocab_size, parts.max_model_len)
