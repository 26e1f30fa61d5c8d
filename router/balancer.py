"""Which worker gets a request: the routing policy, as plain bookkeeping (no Ray calls).

Each ``WorkerRecord`` (``router.registry``) carries what the router itself
knows (prompt tokens it sent to a prefill worker and not yet got back;
requests in flight), the last stats the worker reported, and the block hashes
of its prefix cache (``router.prefix_index``). Between two stats polls the
registry counts the router's own reservations, so a burst does not all land on
the worker that looked emptiest. ``Prompt`` is the request as routing sees it:
its length and the hash chain of its full blocks.

- prefill: the least prompt work ahead of this prompt's end, counting what the
  worker would take from its cache: ``queued + (n - cached)`` tokens. With
  ``prefix_affinity``, a prompt none of them has cached goes to the worker its
  first block hashes to (rendezvous hashing), unless that worker has
  ``affinity_slack_tokens`` more work than the best; so a burst of prompts that
  share a prefix lands on one worker before any poll has reported the prefix.
- decode: among the workers with room for the sequence, the best weighted sum of
  three scores in [0, 1] (llm-d's scorer pattern): cached prefix (the share of
  the prompt it holds, which a prefill on the decode worker skips), load (fewest
  requests), and free KV. Weights from ``PolicySpec``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from splitserve.router.registry import WorkerRecord
from splitserve.wire.prefix import prompt_block_hashes


@dataclass(frozen=True)
class Prompt:
    """A prompt as routing sees it."""

    num_tokens: int
    block_hashes: tuple[int, ...]  # the named hash of each full block (engine.prefix_cache)

    @staticmethod
    def of(token_ids: list[int], block_size: int) -> Prompt:
        """``block_size`` is any worker's: every pool shares one (the KV handshake's
        compatibility check refuses a mismatch)."""
        return Prompt(len(token_ids), tuple(prompt_block_hashes(token_ids, block_size)))

    def cached_on(self, w: WorkerRecord) -> int:
        """Prompt tokens ``w`` would take from its prefix cache (as last polled)."""
        return w.cached_tokens(self.block_hashes, self.num_tokens)


@dataclass(frozen=True)
class DecodeWeights:
    prefix: float = 2.0
    load: float = 1.0
    kv: float = 1.0


def prefill_work(w: WorkerRecord, prompt: Prompt) -> int:
    """Prompt tokens ``w`` computes before this prompt is done, were it sent there."""
    return w.queued_prompt_tokens + prompt.num_tokens - prompt.cached_on(w)


def pick_prefill(
    workers: list[WorkerRecord],
    prompt: Prompt,
    prefix_affinity: bool = False,
    affinity_slack_tokens: int = 2048,
) -> WorkerRecord | None:
    candidates = [w for w in workers if w.routable]
    if not candidates:
        return None
    best = min(candidates, key=lambda w: (prefill_work(w, prompt), w.active))
    if not prefix_affinity or not prompt.block_hashes or prompt.cached_on(best):
        return best
    head = prompt.block_hashes[0].to_bytes(8, "little")
    preferred = max(candidates, key=lambda w: hashlib.blake2b(head + w.worker_id.encode()).digest())
    if prefill_work(preferred, prompt) - prefill_work(best, prompt) <= affinity_slack_tokens:
        return preferred
    return best


def pick_decode(
    workers: list[WorkerRecord], prompt: Prompt, tokens_needed: int, weights: DecodeWeights = DecodeWeights()
) -> WorkerRecord | None:
    candidates = [w for w in workers if w.routable]
    if not candidates:
        return None
    fits = [w for w in candidates if w.free_tokens >= tokens_needed] or candidates
    most_active = max(w.active for w in fits)
    most_free = max(max(w.free_tokens for w in fits), 1)

    def score(w: WorkerRecord) -> tuple[float, int]:
        cached = prompt.cached_on(w) / prompt.num_tokens if prompt.num_tokens else 0.0
        load = 1.0 - w.active / (most_active + 1)
        kv = max(w.free_tokens, 0) / most_free
        return weights.prefix * cached + weights.load * load + weights.kv * kv, -w.running

    return max(fits, key=score)
