"""Which worker gets a request: the routing policy, as plain bookkeeping (no Ray calls).

Each ``WorkerRecord`` (``router.registry``) carries what the router itself
knows (prompt tokens it sent to a prefill worker and not yet got back;
requests in flight) and the last stats the worker reported. Between two stats
polls the registry counts the router's own reservations, so a burst does not
all land on the worker that looked emptiest.

- prefill: least queued prompt tokens; with ``prefix_affinity`` a prompt goes
  to the worker its first block hashes to (rendezvous hashing), unless that
  worker is ``affinity_slack_tokens`` busier than the least-loaded one.
- decode: the most free KV tokens after reservations, then fewest sequences.
"""

from __future__ import annotations

import hashlib

from splitserve.router.registry import WorkerRecord


def pick_prefill(
    workers: list[WorkerRecord],
    prompt_ids: list[int],
    prefix_affinity: bool = False,
    affinity_slack_tokens: int = 2048,
) -> WorkerRecord | None:
    candidates = [w for w in workers if w.routable]
    if not candidates:
        return None
    least = min(candidates, key=lambda w: (w.queued_prompt_tokens, w.active))
    if not prefix_affinity:
        return least
    head = ",".join(map(str, prompt_ids[: least.block_size])).encode()
    preferred = max(candidates, key=lambda w: hashlib.blake2b(head + w.worker_id.encode()).digest())
    if preferred.queued_prompt_tokens - least.queued_prompt_tokens <= affinity_slack_tokens:
        return preferred
    return least


def pick_decode(workers: list[WorkerRecord], tokens_needed: int) -> WorkerRecord | None:
    candidates = [w for w in workers if w.routable]
    if not candidates:
        return None
    fits = [w for w in candidates if w.free_tokens >= tokens_needed] or candidates
    return max(fits, key=lambda w: (w.free_tokens, -w.active, -w.running))
