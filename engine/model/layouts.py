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

The released gpt-oss checkpoints store the two weight stacks in MXFP4
(``gate_up_proj_blocks`` [E, 2I, H/32, 16] and ``_scales`` [E, 2I, H/32]; the
same for ``down_proj``, [E, H, I/32, ...]): rows are output features, each block
of 32 inputs is 16 bytes of two e2m1 values (low nibble first) and one E8M0
scale (2^(s - 127)). No kernel here runs MXFP4, so each expert is dequantised
as it is read (``_Mxfp4``; exact: every value is a 3-bit mantissa times a
power of two) and held in the model's dtype: bf16 experts take 16 bits a weight
against MXFP4's 4.25, 3.8x (gpt-oss-20b's 19.1 B expert weights: 10.2 GB as
released, 38.2 GB in bf16; gpt-oss-120b's 114.6 B: 60.9 GB, 229 GB).
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
_MXFP4_PARTS = {f"{stack}_{part}" for stack in ("gate_up_proj", "down_proj") for part in ("blocks", "scales")}


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


# e2m1: the 16 values a 4-bit code stands for
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, G, 16] uint8 codes and [..., rows, G] uint8 E8M0 scales -> [..., rows, G*32]
    float32 (see the module docstring)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    out = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)  # low nibble first
    out = torch.ldexp(out.flatten(-2), (scales.to(torch.int32) - 127)[..., None])
    return out.flatten(-2)


@dataclass
class _Mxfp4:
    """An MXFP4 stack read as transformers' dequantised one: [E, inputs, outputs]."""

    blocks: TensorSource
    scales: TensorSource
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        e, rows, groups, width = self.blocks.shape
        return (e, groups * width * 2, rows)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def read(self, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        # what ``_ExpertView`` asks: rows [start, stop) of the stack, i.e. some experts
        got = dequantize_mxfp4(self.blocks.read(dim, start, stop), self.scales.read(dim, start, stop))
        return got.transpose(-1, -2)

    def check(self) -> None:
        b, s = tuple(self.blocks.shape), tuple(self.scales.shape)
        if len(b) != 4 or b[-1] != 16 or b[:-1] != s:
            raise ModelLoadError(
                f"checkpoint tensors {self.name}_blocks {b} and _scales {s} are not MXFP4 stacks "
                "([E, rows, groups, 16] and [E, rows, groups])"
            )


Named = tuple[str, TensorSource]


def unstacked(cfg: ModelConfig, weights: Iterable[Named]) -> Iterator[Named]:
    """``weights`` with every stack of ``cfg``'s family replaced by its per-expert views
    (see the module docstring; an MXFP4 stack once both its blocks and scales came);
    other tensors pass through."""
    halves: dict[str, dict[str, TensorSource]] = {}  # MXFP4 stack -> "blocks"/"scales" seen so far
    for name, source in weights:
        stack = name.rsplit(".", 1)[-1]
        if cfg.model_type != "gpt_oss" or ".mlp.experts." not in name:
            yield name, source
        elif name.split(".mlp.experts.", 1)[1].split(".", 1)[0].isdigit():
            yield name, source  # one expert's already (random weights are drawn so)
        elif stack in _MXFP4_PARTS:
            base, part = name.rsplit("_", 1)
            got = halves.setdefault(base, {})
            got[part] = source
            if len(got) == 2:
                del halves[base]
                mx = _Mxfp4(got["blocks"], got["scales"], base)
                mx.check()
                yield from _views(base, base.rsplit(".", 1)[-1], mx)
        elif stack not in _GPT_OSS:
            raise ModelLoadError(f"checkpoint tensor {name} has no place in the model")
        else:
            yield from _views(name, stack, source)
    for base, got in halves.items():
        (have,) = got
        raise ModelLoadError(
            f"checkpoint tensor {base}_{have} has no {base}_{'scales' if have == 'blocks' else 'blocks'}"
        )


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
