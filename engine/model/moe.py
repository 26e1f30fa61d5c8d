"""The mixture-of-experts MLP every MoE family shares (Mixtral, Qwen2/3-MoE, DeepSeek-V3).

One step's tokens go through it as one packed batch::

    x [T, H] --gate--> logits [T, E] (float32) --route--> weights [T, k], expert ids [T, k]
       |
       +-- grouped_experts: the T*k (token, expert) pairs sorted by expert, so each
       |   expert's tokens are one contiguous run of rows
       |       expert e, rows [s_e, s_e + n_e):  gate_up [n_e, 2I] -> silu(gate) * up -> down [n_e, H]
       |   (one GEMM pair per expert that got tokens; none for the others), each row
       |   scaled by its routing weight and added back into its token's row
       +-- shared experts: one dense MLP over every token (Qwen2-MoE scales it by
           sigmoid(shared_expert_gate(x)))

Expert weights keep their own layout, stacked: ``experts.gate_up_proj [E, 2I, H]``
(gate rows, then up rows) and ``experts.down_proj [E, H, I]``, the checkpoint's
``experts.N.{gate,up,down}_proj`` (Mixtral's ``w1, w3, w2``) read into row N.
gpt-oss's experts also have biases (``experts.gate_up_bias [E, 2I]``,
``experts.down_bias [E, H]``) and its clamped SwiGLU (``ExpertForm``); its router
a bias. The Triton kernel runs both.

Under tensor parallelism each rank holds every expert's slice of the intermediate
width (gate/up rows and down columns [i0, i1), as a dense MLP's), and the partial
outputs are summed by one all-reduce. Routing is computed the same on every rank.
Under expert parallelism (``ep``) each rank holds whole experts, a range of them,
and runs its own tokens; ``engine.parallel.expert_parallel`` sends each (token,
expert) pair to the expert's rank and the result back.

``routed`` counts the rows each expert this rank holds has computed since the
last ``take_routed`` (the expert load ``splitserve status`` shows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model.config import ModelConfig, MoEConfig
from splitserve.engine.model.llama import MLP
from splitserve.engine.parallel.expert_parallel import ExpertShard, dispatch_combine
from splitserve.engine.parallel.group import TPGroup


def route(logits: torch.Tensor, correction_bias: torch.Tensor | None, moe: MoEConfig):
    """(weights [T, k] float32, expert ids [T, k] int64) of float32 router ``logits``
    [T, E], by the rule ``MoEConfig`` states: experts chosen by score (+ the
    correction bias) within the best groups, weighted by their uncorrected score."""
    scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if moe.num_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, moe.num_groups, e // moe.num_groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(moe.topk_groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // moe.num_groups, dim=1), float("-inf"))
    ids = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling if moe.routed_scaling != 1.0 else weights, ids


@dataclass(frozen=True)
class ExpertForm:
    """What an expert computes beside its two GEMMs (gpt-oss): biases stacked as the
    experts are (``gate_up_bias`` [E, 2I], ``down_bias`` [E, H]; None: none, or
    added by another tensor-parallel rank) and the activation of ``MoEConfig``."""

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def activate(self, h: torch.Tensor, inter: int) -> torch.Tensor:
        """[n, 2I] gate and up (biased) -> [n, I]."""
        gate, up = h[:, :inter], h[:, inter:]
        if self.activation == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def grouped_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
    kernel: Callable | None = None,
    form: ExpertForm | None = None,
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight x expert(x), [T, H] in ``x``'s
    dtype. ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] hold experts
    [first_expert, first_expert + E); pairs routed to other experts add nothing
    (their expert lives on another rank). Tokens are grouped by expert (see the
    module docstring): a Python loop over the experts that got tokens, none over
    tokens, which reads the counts on the host; or ``kernel``
    (``kernels.triton_moe.fused_experts``: two launches, nothing read back, so a CUDA
    graph captures it), called as ``kernel(x, weights, ids, first_expert, gate_up,
    down, form)``."""
    if kernel is not None:
        return kernel(x, weights, ids, first_expert, gate_up, down, form)
    t, k = ids.shape
    held = gate_up.shape[0]
    local = ids.reshape(-1) - first_expert
    local = torch.where((local >= 0) & (local < held), local, held)  # ``held``: an expert elsewhere
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=held + 1)[:held].tolist()
    order = order[: sum(counts)]
    token = order // k
    out = _grouped(x.index_select(0, token), counts, gate_up, down, form)
    out.mul_(weights.reshape(-1).index_select(0, order).to(out.dtype)[:, None])
    return torch.zeros_like(x).index_add_(0, token, out)


def expert_rows(
    rows: torch.Tensor,
    expert: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    kernel: Callable | None = None,
    form: ExpertForm | None = None,
):
    """Row i through expert ``expert[i]`` (an index into the stacks ``gate_up``
    [E, 2I, H] and ``down`` [E, H, I]), unweighted, [N, H] in the rows' order (what an
    expert-parallel rank computes for the rows other ranks sent it)."""
    if kernel is not None:  # each row one pair of weight 1
        ones = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=rows.device)
        return kernel(rows, ones, expert.reshape(-1, 1), 0, gate_up, down, form)
    order = expert.argsort(stable=True)
    counts = torch.bincount(expert, minlength=gate_up.shape[0]).tolist()
    out = _grouped(rows.index_select(0, order), counts, gate_up, down, form)
    return torch.empty_like(out).index_copy_(0, order, out)


def _grouped(
    rows: torch.Tensor,
    counts: list[int],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    form: ExpertForm | None = None,
):
    """``rows`` sorted by expert, ``counts[e]`` of them for expert e, each through its
    expert: one GEMM pair per expert that has rows, in place of a loop over tokens."""
    form = form or ExpertForm()
    out = torch.empty_like(rows)
    inter = down.shape[2]
    start = 0
    for e, count in enumerate(counts):
        if count:
            up_bias = None if form.gate_up_bias is None else form.gate_up_bias[e]
            down_bias = None if form.down_bias is None else form.down_bias[e]
            h = F.linear(rows[start : start + count], gate_up[e], up_bias)
            out[start : start + count] = F.linear(form.activate(h, inter), down[e], down_bias)
            start += count
    return out


class Router(nn.Module):
    """``weight`` [E, H] (and DeepSeek-V3's ``e_score_correction_bias`` [E], gpt-oss's
    ``bias`` [E]); logits in float32 whatever the model's dtype (the reference
    implementations route in float32). Not an ``nn.Linear``, so quantization and CPU
    packing leave it alone."""

    def __init__(self, num_experts: int, hidden: int, correction_bias: bool, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts), requires_grad=False) if correction_bias else None
        )
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias)


class Experts(nn.Module):
    """The routed experts this rank holds, stacked (see the module docstring)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.gate_up_bias = self.down_bias = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * inter), requires_grad=False)
            self.down_bias = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)


class SparseMoE(nn.Module):
    """A MoE layer as rank ``tp.rank`` of ``tp`` holds it, or, with ``ep`` (a group of
    more than one), rank ``ep.rank``'s share of the experts (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None, ep: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        moe = cfg.moe
        self.moe = moe
        self.group = tp
        self.ep = ep if ep is not None and ep.size > 1 else None
        self.shard = (
            ExpertShard.of(moe.num_experts, ep.rank, ep.size) if self.ep else ExpertShard(0, moe.num_experts)
        )
        self.inter = moe.intermediate_size // tp.size
        self.gate = Router(moe.num_experts, cfg.hidden_size, moe.correction_bias, moe.router_bias)
        self.experts = Experts(self.shard.count, cfg.hidden_size, self.inter, moe.expert_bias)
        self.shared_experts = (
            MLP(cfg, tp, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        )
        self.shared_expert_gate = Router(1, cfg.hidden_size, False) if moe.shared_gate else None
        self.routed: torch.Tensor | None = None  # made on the device of the first rows counted, then kept
        self.grouped_kernel: Callable | None = None  # DecoderModel.use_kernels: the Triton one on CUDA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.gate.e_score_correction_bias, self.moe)
        if self.ep is not None:
            out = dispatch_combine(self.ep, x, weights, ids, self.shard.count, self._held_experts)
        else:
            if self.group.is_driver:  # the rank stats read (every rank routes the same)
                self._count(ids.reshape(-1))
            gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
            out = self.group.all_reduce(
                grouped_experts(x, gate_up, down, weights, ids, kernel=self.grouped_kernel, form=self._form())
            )
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = shared * self.shared_expert_gate(x).sigmoid().to(shared.dtype)
            out = out + shared
        return out

    def take_routed(self) -> list[int]:
        """Rows each held expert computed since the last call (and start counting again).
        Call it between steps, on the thread that runs them: it reads the device's
        counts (a sync). Under CUDA graphs a replay's padding rows count too (token 0,
        routed as any)."""
        if self.routed is None:
            return [0] * self.shard.count
        counts = self.routed.tolist()
        self.routed.zero_()
        return counts

    def _held_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        self._count(local_ids)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        return expert_rows(rows, local_ids, gate_up, down, self.grouped_kernel, self._form())

    def _form(self) -> ExpertForm | None:
        """The experts' biases and activation where they have them (None: plain SwiGLU).
        The down projection's bias is added by one rank of a tensor-parallel group (the
        partial outputs are summed), by every expert-parallel rank for its own experts."""
        moe, experts = self.moe, self.experts
        if not moe.expert_bias and moe.activation == "silu":
            return None
        down_bias = experts.down_bias if self.ep is not None or self.group.is_driver else None
        return ExpertForm(experts.gate_up_bias, down_bias, moe.activation, moe.swiglu_alpha, moe.swiglu_limit)

    def _count(self, local_ids: torch.Tensor) -> None:
        """Add the rows to ``routed`` in place, reading nothing back: a recorded CUDA
        graph keeps counting into the same tensor when replayed."""
        if self.routed is None:  # not an inference tensor: ``take_routed`` zeroes it outside a step
            with torch.inference_mode(False):
                self.routed = torch.zeros(self.shard.count, dtype=torch.long, device=local_ids.device)
        self.routed.index_add_(0, local_ids, torch.ones_like(local_ids, dtype=torch.long))
