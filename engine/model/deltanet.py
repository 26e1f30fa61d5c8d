"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5, over packed
batches, each sequence's memory a fixed-size state in a slot of a state pool.

Per value head, with the key ``k_t`` and query ``q_t`` L2-normalised (the query then
scaled by ``d_k^-1/2``), a decay ``a_t = exp(g_t)`` and a write strength ``b_t``, the
state ``S`` ([d_k, d_v]) and the output ``o_t`` are::

    S  <- a_t * S                              decay
    S  <- S + k_t (b_t (v_t - S^T k_t))^T      the delta rule: write the correction
    o_t = S^T q_t

Before it, a depthwise causal convolution of width K (then SiLU) over the concatenated
q, k, v projections, whose state is the last K - 1 inputs; after it, an RMSNorm of
each head's output gated by SiLU(z), and the output projection. The two states are
the layer's whole memory of a sequence: ``DeltaStates`` holds them per slot.

Prefill runs the chunked form (chunks of ``CHUNK`` tokens: within a chunk the
writes are solved as one unit-triangular system, across chunks the state carries
on; no Python loop per token), decode the recurrent form batched over sequences.
A step reads each sequence's state from one slot and writes the next to another
(``DeltaSpan``: the runner swaps them once the step ran whole, so a failed step runs
again from the same state), so a prompt prefilled in chunks over several steps
carries its state across them; with prefix caching the state at the last block
boundary a step crosses also goes to a third slot, a snapshot to be
(``engine.state_slots``). Everything inside runs in float32, as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.parallel.layers import RowParallelLinear

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x`` over its last dimension scaled to unit length (``eps`` inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """One sequence's ``L`` tokens through the gated delta rule from ``state``.

    ``q``, ``k`` [L, H, d_k] (normalised and scaled already), ``v`` [L, H, d_v], ``g``
    (log decay, <= 0) and ``beta`` [L, H], all float32; ``state`` [H, d_k, d_v] float32,
    overwritten with the state after the last token. Returns the outputs [L, H, d_v].

    Within a chunk of C tokens (positions 1..C, cumulative log decay c_i), each
    token's write depends on the writes before it in the chunk; with
    ``D_ij = exp(c_i - c_j)`` (j <= i) the writes ``u`` solve the unit lower-triangular
    system ``(I + tril(diag(b) K K^T * D, -1)) u = b (V - exp(c) K S_0)`` (S_0: the state
    entering the chunk), split as ``u = U - W S_0``; then the outputs are
    ``exp(c) Q S_0 + (Q K^T * D) u`` and the state leaving the chunk
    ``exp(c_C) S_0 + (exp(c_C - c) K)^T u``."""
    length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -length % chunk
    n = (length + pad) // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, n, C, ...]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad)) if pad else x
        return x.reshape(n, chunk, heads, *x.shape[2:]).movedim(2, 0)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]  # [H, n, C]
    c = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # D: [H, n, C, C]
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk, device=q.device)
    rhs = torch.cat([v * beta[..., None], kb * c.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    writes, reads = solved[..., :dv], solved[..., dv:]  # U and W
    scores = q @ k.transpose(-1, -2) * decay  # within the chunk, causal
    q_decayed = q * c.exp()[..., None]
    tail = c[..., -1:]
    k_to_end = k * (tail - c).exp()[..., None]
    out = torch.empty(heads, n, chunk, dv, dtype=q.dtype, device=q.device)
    s = state
    for i in range(n):
        u = writes[:, i] - reads[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ u
        s = s * tail[:, i, :, None].exp() + k_to_end[:, i].transpose(-1, -2) @ u
    state.copy_(s)
    return out.reshape(heads, n * chunk, dv)[:, :length].transpose(0, 1)


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """One token of each of B sequences: ``q``, ``k`` [B, H, d_k], ``v`` [B, H, d_v],
    ``g``, ``beta`` [B, H], float32; ``states`` [B, H, d_k, d_v] float32, updated in
    place. Returns the outputs [B, H, d_v]."""
    states.mul_(g.exp()[..., None, None])
    predicted = (states * k[..., None]).sum(-2)  # S^T k
    states.add_(k[..., None] * ((v - predicted) * beta[..., None])[..., None, :])
    return (states * q[..., None]).sum(-2)


@dataclass
class DeltaStates:
    """One linear-attention layer's states, a row per slot: ``conv`` [slots, channels,
    K - 1] (the last K - 1 inputs of the convolution, in the model's dtype) and
    ``recurrent`` [slots, value heads, d_k, d_v] (float32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def empty(cls, slots: int, channels: int, width: int, heads: int, dk: int, dv: int, dtype, device=None):
        return cls(
            torch.zeros(slots, channels, width - 1, dtype=dtype, device=device),
            torch.zeros(slots, heads, dk, dv, dtype=torch.float32, device=device),
        )


@dataclass(frozen=True)
class DeltaSpan:
    """A sequence's tokens in a packed step, [start, start + length): they continue from
    the state in slot ``slot`` (zeros when ``fresh``: they are its first) and leave the
    state after them in slot ``out``, another one, so that the step can run again
    from the same state when it fails (``engine.containment``) and the sequence moves
    to ``out`` only once it succeeded (``ModelRunner``)."""

    start: int
    length: int
    slot: int
    out: int
    fresh: bool = False
    # with ``mark`` > 0 the state after the span's first ``mark`` tokens (a block
    # boundary) is also written to slot ``mark_slot`` (a prefix's snapshot to be)
    mark: int = 0
    mark_slot: int = -1


class RMSNormGated(nn.Module):
    """Each head's output RMS-normalised (float32), scaled by ``weight`` in the input's
    dtype, then multiplied by SiLU of the gate ``z`` (float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(z.float())).to(dtype)


@dataclass(frozen=True)
class DeltaShape:
    """A Gated DeltaNet layer's sizes (a config's ``linear_*`` fields)."""

    hidden: int
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    conv_width: int
    eps: float

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.dk

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.dv

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim


def delta_shape(cfg, tp_size: int = 1) -> DeltaShape:
    """The linear layers' shape of a hybrid ``ModelConfig``, on each of ``tp_size``
    ranks (each holds ``1 / tp_size`` of the key and value heads, and their states)."""
    lin = cfg.linear
    return DeltaShape(
        cfg.hidden_size,
        lin.k_heads // tp_size,
        lin.v_heads // tp_size,
        lin.k_head_dim,
        lin.v_head_dim,
        lin.conv_width,
        cfg.rms_norm_eps,
    )


def as_ours(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers Gated DeltaNet layer's ``state_dict`` under ``GatedDeltaNet``'s
    names (its row-parallel ``out_proj`` holds its weight one level down)."""
    return {("out_proj.linear.weight" if k == "out_proj.weight" else k): v for k, v in state_dict.items()}


class GatedDeltaNet(nn.Module):
    """One linear-attention layer, its parameters named as the checkpoints name them:
    Qwen3-Next's fused ``in_proj_qkvz`` and ``in_proj_ba`` (grouped per key head), or
    Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``
    (``fused``); ``conv1d.weight`` [channels, 1, K], ``dt_bias``, ``A_log``,
    ``norm.weight``, ``out_proj``. Under tensor parallelism ``shape`` is this rank's
    (``delta_shape(cfg, tp.size)``): its key heads and their value heads, whose
    projections, channels and states it holds, and ``out_proj`` row-parallel over
    ``tp`` (``engine.model.placement`` reads each rank's rows)."""

    def __init__(self, shape: DeltaShape, fused: bool, tp: TPGroup | None = None):
        super().__init__()
        self.shape, self.fused = shape, fused
        s = shape
        if fused:
            self.in_proj_qkvz = nn.Linear(s.hidden, 2 * s.key_dim + 2 * s.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(s.hidden, 2 * s.v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(s.hidden, s.conv_channels, bias=False)
            self.in_proj_z = nn.Linear(s.hidden, s.value_dim, bias=False)
            self.in_proj_b = nn.Linear(s.hidden, s.v_heads, bias=False)
            self.in_proj_a = nn.Linear(s.hidden, s.v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            s.conv_channels, s.conv_channels, s.conv_width, groups=s.conv_channels, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(s.v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.v_heads))
        self.norm = RMSNormGated(s.dv, s.eps)
        self.out_proj = RowParallelLinear(s.value_dim, s.hidden, False, tp or TPGroup.single())

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv [T, channels] in q | k | v order, z [T, v_heads, dv], b, a [T, v_heads])."""
        s, t = self.shape, x.shape[0]
        if not self.fused:
            z = self.in_proj_z(x).view(t, s.v_heads, s.dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        per = s.v_heads // s.k_heads  # value heads per key head: the fused rows are grouped by key head
        qkvz = self.in_proj_qkvz(x).view(t, s.k_heads, 2 * s.dk + 2 * per * s.dv)
        q, k, v, z = qkvz.split([s.dk, s.dk, per * s.dv, per * s.dv], dim=-1)
        ba = self.in_proj_ba(x).view(t, s.k_heads, 2 * per)
        b, a = ba.split([per, per], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, s.v_heads, s.dv), b.reshape(t, s.v_heads), a.reshape(t, s.v_heads)

    def forward(self, x: torch.Tensor, spans: list[DeltaSpan], states: DeltaStates) -> torch.Tensor:
        """``x`` [T, hidden], the packed tokens of ``spans`` (each sequence's new tokens,
        in order, continuing from the state in its ``slot``); returns [T, hidden] and
        writes each sequence's state after its last token to its ``out`` slot, leaving
        ``slot`` as it was."""
        s = self.shape
        qkv, z, b, a = self._project(x)
        mixed = self._convolve(qkv, spans, states.conv)
        q, k, v = mixed.float().split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        per = s.v_heads // s.k_heads
        t = x.shape[0]
        q = (l2_normalize(q.view(t, s.k_heads, s.dk)) * s.dk**-0.5).repeat_interleave(per, dim=1)
        k = l2_normalize(k.view(t, s.k_heads, s.dk)).repeat_interleave(per, dim=1)
        v = v.view(t, s.v_heads, s.dv)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(t, s.v_heads, s.dv, dtype=torch.float32, device=x.device)
        ones = [sp for sp in spans if sp.length == 1]
        if ones:
            rows, held, outs = _gather(ones, states.recurrent, x.device)
            out[rows] = recurrent_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], held)
            states.recurrent[outs] = held
            marked = [i for i, sp in enumerate(ones) if sp.mark]
            if marked:
                states.recurrent[[ones[i].mark_slot for i in marked]] = held[marked]
        for sp in spans:
            if sp.length > 1:
                before = states.recurrent[sp.slot]
                held = torch.zeros_like(before) if sp.fresh else before.clone()
                first, end = sp.start + sp.mark, sp.start + sp.length  # mark 0: no boundary kept
                if sp.mark:  # up to the block boundary, whose state is kept, then the rest
                    r = slice(sp.start, first)
                    out[r] = chunked_delta_rule(q[r], k[r], v[r], g[r], beta[r], held)
                    states.recurrent[sp.mark_slot] = held
                if first < end:
                    r = slice(first, end)
                    out[r] = chunked_delta_rule(q[r], k[r], v[r], g[r], beta[r], held)
                states.recurrent[sp.out] = held
        y = self.norm(out.to(x.dtype), z)
        return self.out_proj(y.reshape(t, s.value_dim))

    def _convolve(self, qkv: torch.Tensor, spans: list[DeltaSpan], conv: torch.Tensor) -> torch.Tensor:
        """The causal depthwise convolution (then SiLU) of each span's rows, continuing
        from its ``slot``'s last K - 1 inputs and leaving them, moved on, in ``out``."""
        w = self.conv1d.weight[:, 0]  # [channels, K]
        width = w.shape[1]
        out = torch.empty_like(qkv)
        ones = [sp for sp in spans if sp.length == 1]
        if ones:  # one token each: the window is the state and the token, batched
            rows, held, outs = _gather(ones, conv, qkv.device)
            window = torch.cat([held, qkv[rows, :, None].to(conv.dtype)], dim=2)  # [B, channels, K]
            conv[outs] = window[:, :, 1:]
            marked = [i for i, sp in enumerate(ones) if sp.mark]
            if marked:
                conv[[ones[i].mark_slot for i in marked]] = window[marked, :, 1:]
            out[rows] = F.silu((window.to(w.dtype) * w).sum(-1)).to(qkv.dtype)
        for sp in spans:
            if sp.length == 1:
                continue
            r = slice(sp.start, sp.start + sp.length)
            before = torch.zeros_like(conv[sp.slot]) if sp.fresh else conv[sp.slot]
            window = torch.cat([before, qkv[r].T.to(conv.dtype)], dim=1)  # [channels, K - 1 + L]
            conv[sp.out] = window[:, -(width - 1) :]
            if sp.mark:  # the K - 1 inputs before the boundary
                conv[sp.mark_slot] = window[:, sp.mark : sp.mark + width - 1]
            y = F.conv1d(window[None].to(w.dtype), w[:, None], groups=w.shape[0])[0]  # [channels, L]
            out[r] = F.silu(y).T.to(qkv.dtype)
        return out


def _gather(
    spans: list[DeltaSpan], pool: torch.Tensor, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(their rows in the step, a copy of their slots' states (zeros for a fresh one),
    their ``out`` slots) of one-token spans."""
    rows = torch.tensor([sp.start for sp in spans], device=device)
    held = pool[torch.tensor([sp.slot for sp in spans], device=device)]
    fresh = [i for i, sp in enumerate(spans) if sp.fresh]
    if fresh:
        held[fresh] = 0
    return rows, held, torch.tensor([sp.out for sp in spans], device=device)
