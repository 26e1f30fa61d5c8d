"""Checkpoints that stack many of the model's tensors into one, read as the tensors
the model has (``placement.checkpoint_tensor_shapes``): one lazy view per expert.

gpt-oss (transformers' layout, and the bf16 releases) stores each layer's experts
as four stacks, gate and up interleaved column by column and the projections
transposed against ``nn.Linear``::

    mlp.experts.gate_up_proj       [E, H, 2I]  -> experts.N.gate_proj.weight [I, H] (columns 0, 2, ...)
                                                  experts.N.up_proj.weight   [I, H] (columns 1, 3, ...)
    mlp.experts.gate_up_proj_bias  [E, 2I]     -> experts.N.gate_proj.bias, experts.N.up_proj.bias
    mlp.experts.down_proj          [E, I, H]   -> experts.N.down_proj.weight [H, I]
    mlp.experts.down_proj_bias     [E, H]      -> experts.N.down_proj.bias

A view reads its expert's row of the stack when the loader asks for it (a rank
reads only the experts it holds), so memory stays one expert in flight.
MXFP4 stacks (``*_blocks``, ``*_scales``: the released gpt-oss checkpoints) are
refused with a sentence: they are not dequantised yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from splitserve.engine.model.checkpoint import TensorSource, _index
from splitserve.engine.model.config import ModelConfig
from splitserve.wire.errors import ModelLoadError

# stack -> ((canonical tail, the expert's tensor from its row of the stack), ...)
_GPT_OSS: dict[str, tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...]] = {
    "gate_up_proj": (
        ("gate_proj.weight", lambda row: row[:, 0::2].t()),
        ("up_proj.weight", lambda row: row[:, 1::2].t()),
    ),
    "gate_up_proj_bias": (
        ("gate_proj.bias", lambda row: row[0::2]),
        ("up_proj.bias", lambda row: row[1::2]),
    ),
    "down_proj": (("down_proj.weight", lambda row: row.t()),),
    "down_proj_bias": (("down_proj.bias", lambda row: row),),
}
_NDIM = {"gate_up_proj": 3, "gate_up_proj_bias": 2, "down_proj": 3, "down_proj_bias": 2}


@dataclass
class _ExpertView:
    """Expert ``expert``'s tensor of a stack, as ``take`` makes it from the stack's row."""

    source: TensorSource
    expert: int
    take: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    def read(self, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        full = self.take(self.source.read(0, self.expert, self.expert + 1)[0])
        return full[_index(full.dim(), dim, start, stop)]


Named = tuple[str, TensorSource]


def unstacked(cfg: ModelConfig, weights: Iterable[Named]) -> Iterator[Named]:
    """``weights`` with every stack of ``cfg``'s family replaced by its per-expert views
    (see the module docstring); other tensors pass through."""
    for name, source in weights:
        stack = name.rsplit(".", 1)[-1]
        if cfg.model_type != "gpt_oss" or ".mlp.experts." not in name:
            yield name, source
        elif stack.endswith(("_blocks", "_scales")):
            raise ModelLoadError(
                f"checkpoint tensor {name} is MXFP4 (blocks and scales), which splitserve does not load "
                "yet: use a bf16 release of the model (e.g. one saved by transformers after dequantising)"
            )
        elif stack not in _GPT_OSS:
            raise ModelLoadError(f"checkpoint tensor {name} has no place in the model")
        else:
            yield from _views(name, stack, source)


def _views(name: str, stack: str, source: TensorSource) -> Iterator[Named]:
    if len(source.shape) != _NDIM[stack]:
        raise ModelLoadError(
            f"checkpoint tensor {name} has shape {tuple(source.shape)}; a stack of experts has "
            f"{_NDIM[stack]} dimensions"
        )
    prefix = name.removesuffix(stack)
    row_shape = tuple(source.shape[1:])
    for e in range(source.shape[0]):
        for tail, take in _GPT_OSS[stack]:
            shape = tuple(take(torch.empty(row_shape, device="meta")).shape)
            yield f"{prefix}{e}.{tail}", _ExpertView(source, e, take, shape)
