"""A handoff proven by meaning: the KV a request brought in, checked by computing its
prompt's last position again over it (``check_import``; issue 68).

The integrity hashes (``kv_transfer.integrity``) prove that the bytes a source sent
are the bytes that landed; they cannot see right bytes in the wrong place: a wrong
block table, layers or KV heads swapped by a mapping, FP8 scales of another layer, a
prefix block credited to other tokens. This check can. With the KV in place and
before the request runs, the engine runs the prompt's last token once more, at its
position, over the KV it now holds for the positions before it, and compares

- ``kv``: the K and V it computes for that position, layer by layer, with what it
  received there (relative L2 error within ``TOLERANCE`` of the cache's dtype). Each
  layer's K/V at a position come from the layer's input there, which attention made
  from every position before it: a fault in any block the layers read, or at the
  position itself, moves them by far more than rounding (about 1.4 for unrelated
  vectors, against 1e-6 to 0.03 for the same computation by another path);
- ``token``: where the first token was the logits' argmax (greedy, nothing else
  steering it), the token this computation chooses against the first token the
  prefill side sampled, a near tie of the two allowed.

It costs one token's forward pass, outside the batch. The received K/V at that
position are put back after it, so a checked request decodes on exactly what an
unchecked one would (in bfloat16 the recomputed values, equal within the tolerance,
could tip a later greedy choice). Not checked
(``MeaningCheck.skipped`` says why): a one-token prompt, a hybrid model (its linear
layers' state is past the last position already, and would take that token twice),
a sliding-window model once its window has left the prompt's start (its sliding
layers no longer hold every key that position read), expert parallelism, a model
with its MTP layer. Under tensor
parallelism the driver checks its own share of the KV heads.
"""

from __future__ import annotations

import dataclasses

import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.scheduler import ScheduledSeq
from splitserve.engine.sequence import Sequence
from splitserve.wire.kv import MeaningCheck
from splitserve.wire.sampling import MAX_TOP_LOGPROBS

# The largest relative L2 error of one layer's K/V at a position, between the source's
# computation and this one, that is rounding: by the cache's dtype (an FP8 cache's
# values are rounded to 3 mantissa bits after the model's dtype rounded them).
TOLERANCE = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.1, "float8_e4m3fn": 0.15}
# How far below the best a source's deterministic first token's log-probability here may
# be and still count as chosen alike (a near tie the two computations broke apart: 2 of
# 32 SmolLM2 bf16 prompts of random tokens had one), by the cache's dtype.
TIE_MARGIN = {"float32": 0.01, "float16": 0.25, "bfloat16": 0.25, "float8_e4m3fn": 0.5}


def check_import(
    seq: Sequence, first: int | None, kv_cache: KVCache, runner, block_size: int
) -> MeaningCheck:
    """Check the KV an IMPORTING ``seq`` holds (the module docstring) by running its
    prompt's last position again through ``runner`` (``ModelRunner.execute``); ``first``:
    the first token the source sampled (None: the K/V alone are checked)."""
    p = seq.num_prompt_tokens - 1
    skipped = _why_not(seq, runner, p)
    if skipped:
        return MeaningCheck(True, p, skipped=skipped)
    slots = _slots(kv_cache, seq, p, block_size)
    held = [x.clone() for x in slots]  # the received bytes, put back after the check
    received = _values(kv_cache, held)
    asked = dataclasses.replace(seq.params, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS)
    shadow = Sequence(seq.request_id, list(seq.prompt_token_ids), asked)
    shadow.block_table, shadow.window_tables = seq.block_table, seq.window_tables
    shadow.lora_slot = seq.lora_slot
    shadow.window_start, shadow.num_computed_tokens = seq.window_start, p
    try:
        _, sampled, _ = runner.execute([ScheduledSeq(shadow, 1)])
        again = _values(kv_cache, slots)
    finally:  # the request decodes on what it received, as an unchecked one would
        for slot, x in zip(slots, held, strict=True):
            slot.copy_(x)
    tolerance, worst = TOLERANCE.get(kv_cache.layout.dtype, 0.15), 0.0
    for layer, (r, a) in enumerate(zip(received, again, strict=True)):
        error = float((a - r).norm() / r.norm().clamp_min(1e-12))
        if not error <= tolerance:  # NaN fails too
            return MeaningCheck(False, p, "kv", layer, error, tolerance)
        worst = max(worst, error)
    chosen = sampled.token_ids[0] if sampled is not None else -1  # -1: its row could not be sampled
    if first is not None and chosen >= 0 and _deterministic(seq):
        margin = TIE_MARGIN.get(kv_cache.layout.dtype, 0.5)
        tops = dict(sampled.top_logprobs[0] or ())
        best, theirs = tops.get(chosen, 0.0), tops.get(first, -float("inf"))  # not in the top 20: -inf
        if chosen != first and not best - theirs <= margin:
            detail = (
                f"the prompt's last position chooses token {chosen} here (logprob {best:.3g}), {first} at "
                f"the source (here {theirs:.3g}; a tie allows {margin:g})"
            )
            return MeaningCheck(False, p, "token", error=worst, tolerance=tolerance, detail=detail)
    return MeaningCheck(True, p, error=worst, tolerance=tolerance)


def _slots(kv_cache: KVCache, seq: Sequence, position: int, block_size: int) -> list[torch.Tensor]:
    """Each layer's K and V (or MLA latent) of ``seq`` at ``position``: views of the cache,
    ``[planes, kv_heads, head_dim]`` (its sliding layers' from their own blocks)."""
    layout = kv_cache.layout
    tables = [seq.block_table] + [[t[0]] * seq.window_start + t for t in seq.window_tables]
    row = position // block_size
    return [
        kv_cache.tensor[layout.row(layer), :, tables[layout.group(layer)][row], position % block_size]
        for layer in range(layout.num_layers)
    ]


def _values(kv_cache: KVCache, slots: list[torch.Tensor]) -> list[torch.Tensor]:
    """``slots``' values as float32 (an FP8 cache's dequantized with its layer's scales)."""
    out = []
    for layer, x in enumerate(slots):
        values = x.to(torch.float32, copy=True)  # a copy, also of a float32 view of the cache
        scales = kv_cache.layer_scales(layer)
        if scales is not None:
            values = values * scales[: x.shape[0], :, None]
        out.append(values)
    return out


def _why_not(seq: Sequence, runner, p: int) -> str:
    if p < 1:
        return "a one-token prompt: no position before its last"
    if seq.state_slot is not None:
        return "a hybrid model's state is past the prompt's last position"
    if seq.window_tables and seq.window_start:
        return "its sliding layers hold no longer every key the prompt's last position read"
    if runner.data_parallel:
        return "expert parallelism (attention data-parallel)"
    if runner.model.mtp is not None:
        return "a model with its MTP layer"
    return ""


def _deterministic(seq: Sequence) -> bool:
    """Whether the source's first token is the raw logits' argmax, which a near tie of
    their log-probabilities explains: greedy, and nothing but the logits choosing (a
    seeded draw, penalties or a bias can turn a rounding difference into another token
    far apart in raw log-probability)."""
    return seq.params.greedy and not seq.params.processes_logits
