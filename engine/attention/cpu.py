"""CPU attention: decode through the native paged kernel (``engine/kernels/csrc/paged_decode.cpp``),
which reads K/V in place through the block tables instead of gathering them;
prefill as in the SDPA backend. Selected automatically on CPU when the kernel
builds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine import kernels
from splitserve.engine.attention.base import SeqSpan, decode_tables
from splitserve.engine.attention.sdpa import SdpaBackend, SdpaMetadata


@dataclass
class CpuMetadata:
    sdpa: SdpaMetadata  # prefill spans (its decode part is left empty)
    num_decodes: int
    block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    context_lens: torch.Tensor | None  # [num_decodes] int64


class CpuBackend(SdpaBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.kernels = kernels.load()
        if self.kernels is None:
            raise RuntimeError("the CPU attention kernels did not build")

    def prepare(self, spans: list[SeqSpan], num_decodes: int, block_size: int, device: torch.device):
        tables = lens = None
        if num_decodes:
            tables, lens = decode_tables(spans[:num_decodes], torch.device("cpu"))
        prefill = super().prepare(spans[num_decodes:], 0, block_size, device)  # q_start stays absolute
        return CpuMetadata(prefill, num_decodes, tables, lens)

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuMetadata, scale: float):
        nd = meta.num_decodes
        if nd == q.shape[0]:
            return self.kernels.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        out = super().forward(q, k, v, k_cache, v_cache, meta.sdpa, scale)
        if nd:
            out[:nd] = self.kernels.paged_decode(
                q[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, scale
            )
        return out
