"""DeepSeek-V3's multi-token prediction (MTP) layer, and GLM-4.5's of the same form:
from the target model's hidden state at position i and the token at i + 1, a
prediction of the token at i + 2.

    h_i (the target's last hidden state, after its final norm)   e = Emb(t_{i+1})
             hnorm                                                 enorm
                 \\__________ eh_proj([enorm(e); hnorm(h)]) _________/
                                       |
                    one decoder layer of the model's (V3: MLA + MoE), index num_layers,
                    its KV at position i in the cache's layer num_layers
                                       |
                         shared_head.norm -> the target's LM head -> t_{i+2}

The checkpoint holds it as ``model.layers.{num_layers}.*`` (``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` and an ordinary layer's tensors). It also ships
copies of the embedding and the LM head (``embed_tokens``, ``shared_head.head``):
the model's own are used, and the copies are not read. The concatenation puts the
embedding first, as the released weights expect (vLLM's and SGLang's order).

The layer's KV is a layer of the target's cache, at the target's slots: it is
written wherever the target's is (``ModelRunner``'s MTP pass, after each step's
sampling) and moves with it in a handoff, a migration or the host tier.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.llama import RMSNorm, StepContext


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: nn.Module):
        """``layer``: a ``DecoderLayer`` of index ``cfg.num_layers`` (the caller builds it:
        this module imports no decoder)."""
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = layer
        self.norm = RMSNorm(h, cfg.rms_norm_eps)  # the checkpoint's shared_head.norm

    def forward(
        self,
        embedded: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        ctx: StepContext,
    ) -> torch.Tensor:
        """[T, hidden] states for the LM head: row i from ``embedded`` (the next
        tokens' embeddings) and ``hidden`` (the target's rows); KV written at ``ctx``'s
        slots of ``kv`` (the cache's MTP layer)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        delta = self.layer(x, None, cos, sin, kv[0], kv[1], ctx)
        return self.norm(x, delta)
