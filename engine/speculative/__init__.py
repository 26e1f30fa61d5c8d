"""Speculative decoding: a proposer suggests a decoding sequence's next few tokens
cheaply, and the engine's target model checks them all in one step.

    engine.step
      1. proposals    each decoding request that speculates asks its proposer for k
                      tokens (k from its own acceptance: ``adaptive``)
      2. schedule     the request runs [last token, d1 .. dk] as one chunk over its
                      paged KV (``Scheduler.schedule(drafts)``), batched with the rest
      3. verify       one target row per position; the sequence keeps the tokens the
                      target itself picks up to the first that differs from the draft,
                      and that one (``verify``)
      4. advance      computed KV moves past the kept tokens only; the slots written
                      for rejected ones are overwritten by the next step, spare blocks
                      given back (``BlockManager.trim``)

Proposers (``Proposer``, built by ``speculative.build``): ``ngram`` (prompt lookup,
no model), ``draft`` (a smaller model), ``self`` (the target's first layers), the
last two ``speculative.draft``'s model proposers, and ``mtp`` (the checkpoint's own
multi-token-prediction layer: ``speculative.mtp``). No torch in this package's
bookkeeping; a model proposer brings its own.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ProposalRequest:
    """What a proposer sees of one decoding sequence: its tokens so far (prompt then
    output), how many to propose at most, the target cache's blocks holding the KV of
    all but its last token (a self-speculation draft reads its own layers' there), and
    the LoRA slot of the adapter it runs under (None: the base model; a
    self-speculation draft runs the target's layers under it)."""

    request_id: str
    token_ids: list[int]
    k: int
    block_table: list[int] = field(default_factory=list)
    lora_slot: int | None = None


class Proposer(Protocol):
    """Suggests next tokens for a batch of sequences."""

    name: str

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Up to ``k`` tokens per request, in order ([] where it has none)."""
        ...

    def forget(self, live: Collection[str]) -> None:
        """Drop whatever it keeps for requests not in ``live`` (the engine's requests)."""
        ...
