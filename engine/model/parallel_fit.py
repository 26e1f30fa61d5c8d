"""Whether a model's shapes split over a parallel group: checked before any rank starts
(``engine.build``, and ``splitserve serve`` before it launches a pool), each failure a
sentence naming the dimension. Shapes only (``ModelConfig``): no torch."""

from __future__ import annotations

from splitserve.engine.model.config import ModelConfig


def check_tp_compatible(cfg: ModelConfig, tp_size: int) -> None:
    """Raise ``ValueError`` naming the dimension that does not split over ``tp_size`` ranks."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if cfg.linear is not None and cfg.linear.k_heads % tp_size:
        raise ValueError(
            f"tensor parallelism of {tp_size} needs the model's linear-attention key heads "
            f"({cfg.linear.k_heads}) to divide by {tp_size}"
        )
    sizes = [("attention heads", cfg.num_heads), ("MLP intermediate size", cfg.intermediate_size)]
    if cfg.moe is not None:
        sizes.append(("expert intermediate size", cfg.moe.intermediate_size))
        sizes.append(("shared experts' intermediate size", cfg.moe.shared_intermediate_size))
    for what, n in sizes:
        if n % tp_size:
            raise ValueError(
                f"tensor parallelism of {tp_size} needs the model's {what} ({n}) to divide by {tp_size}"
            )
    kv = cfg.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"tensor parallelism of {tp_size} needs the model's KV heads ({kv}) to divide by {tp_size} "
            f"(split) or {tp_size} to divide by them (replicated)"
        )


def check_ep_compatible(cfg: ModelConfig, ep_size: int, kv_cache_dtype: str = "auto") -> None:
    """Raise ``ValueError`` with a sentence naming why ``cfg`` cannot run on ``ep_size``
    expert-parallel ranks (nothing for 1)."""
    if ep_size == 1:
        return
    if cfg.linear is not None:
        raise ValueError(
            f"{cfg.model_type} (a hybrid model) runs on one rank for now; ep_size {ep_size} does not"
        )
    if cfg.moe is None:
        raise ValueError(
            f"ep_size {ep_size} needs a mixture-of-experts model; {cfg.model_type} has no experts"
        )
    if cfg.moe.num_experts % ep_size:
        raise ValueError(
            f"ep_size {ep_size} does not divide the model's {cfg.moe.num_experts} routed experts"
        )
    if kv_cache_dtype == "fp8":
        raise ValueError("kv_cache_dtype fp8 does not run with expert parallelism (ep_size > 1) yet")
