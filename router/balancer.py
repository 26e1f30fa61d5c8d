"""Which worker gets a request: the routing policy, as plain bookkeeping (no Ray calls).

Each ``WorkerRef`` carries what the router itself knows (prompt tokens it sent
to a prefill worker and not yet got back; requests in flight) and the last
stats the worker reported. Between two stats polls the router counts its own
reservations, so a burst does not all land on the worker that looked emptiest.

- prefill: least queued prompt tokens; with ``prefix_affinity`` a prompt goes
  to the worker its first block hashes to (rendezvous hashing), unless that
  worker is ``affinity_slack_tokens`` busier than the least-loaded one.
- decode: the most free KV tokens after reservations, then fewest sequences.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class WorkerRef:
    worker_id: str
    role: str  # "prefill", "decode" or "colocated"
    handle: Any  # the Ray actor handle
    block_size: int = 16
    draining: bool = False  # finishing its requests, taking no new ones
    alive: bool = True
    # Router-side bookkeeping.
    queued_prompt_tokens: int = 0
    active: int = 0
    reserved_tokens: int = 0  # KV tokens of requests sent since the last stats poll
    # Last reported by the worker.
    free_blocks: int = 0
    num_blocks: int = 0
    running: int = 0

    @property
    def routable(self) -> bool:
        return self.alive and not self.draining

    @property
    def free_tokens(self) -> int:
        return self.free_blocks * self.block_size - self.reserved_tokens


def pick_prefill(
    workers: list[WorkerRef],
    prompt_ids: list[int],
    prefix_affinity: bool = False,
    affinity_slack_tokens: int = 2048,
) -> WorkerRef | None:
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


def pick_decode(workers: list[WorkerRef], tokens_needed: int) -> WorkerRef | None:
    candidates = [w for w in workers if w.routable]
    if not candidates:
        return None
    fits = [w for w in candidates if w.free_tokens >= tokens_needed] or candidates
    return max(fits, key=lambda w: (w.free_tokens, -w.active, -w.running))
