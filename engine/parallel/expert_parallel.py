"""Expert parallelism: the routed experts of every MoE layer split over the ranks of
a group, each rank holding ``num_experts / size`` whole experts; every rank runs
attention on its own sequences (data-parallel), and only the MoE layers talk.

One MoE layer on rank r, with its own tokens ``x`` [T_r, H] routed to ``ids`` [T_r, k]::

    pairs (token, expert), T_r * k of them, sorted by the rank holding the expert
        -- all-to-all: counts, then rows of x and their expert ids (dispatch) -->
    rank s: every row sent to it, through its experts (``moe.expert_rows``)
        <-- all-to-all: the rows' results, back the way they came (combine) --
    each pair's result x its routing weight, added into its token's row

Every rank takes part in both all-to-alls of every MoE layer in every step, with no
tokens as well (``DecoderModel`` runs the MoE layers alone then), so the group's
collectives pair up. Two tokens of one rank routed to the same remote expert are
sent twice (per pair, not per token: simple, and at top-k <= 8 over a few ranks the
rows a rank gets are mostly distinct pairs anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.parallel.group import TPGroup


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts one rank holds: [first, first + count)."""

    first: int
    count: int

    @classmethod
    def of(cls, num_experts: int, rank: int, size: int) -> ExpertShard:
        if num_experts % size:
            raise ValueError(f"{num_experts} experts do not split evenly over {size} expert-parallel ranks")
        per = num_experts // size
        return cls(rank * per, per)


def dispatch_combine(
    group: TPGroup,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    per_rank: int,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The routed experts' weighted sum for each of this rank's tokens, [T_r, H]:
    ``x`` [T_r, H], ``weights`` / ``ids`` [T_r, k] (global expert ids), ``per_rank``
    experts on each rank of ``group`` (rank s holds [s * per_rank, (s + 1) * per_rank)).
    ``compute(rows, local_ids)`` runs rows this rank received through its own experts
    (``local_ids`` index its stack) and returns their outputs in the same order."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    owner = flat // per_rank
    order = owner.argsort(stable=True)
    send_counts = torch.bincount(owner, minlength=group.size).tolist()
    token = order // k
    rows, recv_counts = group.all_to_all_rows(x.index_select(0, token), send_counts)
    local_ids, _ = group.all_to_all_rows(
        (flat - owner * per_rank).index_select(0, order), send_counts, recv_counts
    )
    done, _ = group.all_to_all_rows(compute(rows, local_ids), recv_counts, send_counts)
    done = done * weights.reshape(-1).index_select(0, order).to(done.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, token, done)
