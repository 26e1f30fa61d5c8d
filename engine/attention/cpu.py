"""CPU attention through the native paged kernels, which read K/V in place
through the block tables instead of gathering them: decode
(``engine/kernels/csrc/paged_decode.cpp``) and, where built with AVX-512 and the
head size is 64 or 128, causal prefill (``paged_prefill.cpp``, 2.0-2.5x torch's
SDPA on 256-512-token prompts); otherwise prefill as in the SDPA backend. Layers
with a sliding window or attention sinks run the SDPA backend's way whole (the
native kernels have neither yet). Selected automatically on CPU when the kernels
build."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine import kernels
from splitserve.engine.attention.base import SeqSpan, decode_tables
from splitserve.engine.attention.sdpa import SdpaBackend, SdpaMetadata


@dataclass
class NativePrefill:
    """The prefill spans as ``paged_prefill`` takes them (all int64)."""

    block_tables: torch.Tensor  # [spans, max_blocks]
    q_starts: torch.Tensor  # [spans] first row of each span in the packed batch
    q_lens: torch.Tensor  # [spans]
    ctx_lens: torch.Tensor  # [spans]


@dataclass
class CpuMetadata:
    prefills: list[SeqSpan]
    block_size: int
    native: NativePrefill | None  # the prefill spans for the native kernel, when it is built
    num_decodes: int
    block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    context_lens: torch.Tensor | None  # [num_decodes] int64
    # the prefill spans for SDPA (decode part empty): built by the first layer that
    # needs them (no native kernel, or a head size it lacks), then shared by the rest
    sdpa: SdpaMetadata | None = None
    spans: list[SeqSpan] | None = None  # every span, for ``whole``
    whole: SdpaMetadata | None = None  # every span for SDPA: windowed and sink layers


class CpuBackend(SdpaBackend):
    name = "cpu"
    reads_fp8_kv = False  # the native kernels read the model's dtype
    windows_and_sinks = True  # through SDPA (module docstring)

    def __init__(self) -> None:
        self.kernels = kernels.load()
        if self.kernels is None:
            raise RuntimeError("the CPU attention kernels did not build")
        self.native_prefill = self.kernels.has_paged_prefill()

    def prepare(self, spans: list[SeqSpan], num_decodes: int, block_size: int, device: torch.device):
        tables = lens = None
        if num_decodes:
            tables, lens = decode_tables(spans[:num_decodes], torch.device("cpu"))
        prefills = spans[num_decodes:]
        native = None
        if prefills and self.native_prefill:
            ptables, ctx = decode_tables(prefills, torch.device("cpu"))
            native = NativePrefill(
                ptables,
                torch.tensor([s.q_start for s in prefills], dtype=torch.long),
                torch.tensor([s.q_len for s in prefills], dtype=torch.long),
                ctx,
            )
        return CpuMetadata(prefills, block_size, native, num_decodes, tables, lens, spans=spans)

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: CpuMetadata,
        scale: float,
        kv_scales=None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ):
        if window is not None or sinks is not None or softcap is not None:
            if meta.whole is None:
                meta.whole = super().prepare(meta.spans, meta.num_decodes, meta.block_size, q.device)
            return super().forward(
                q, k, v, k_cache, v_cache, meta.whole, scale, window=window, sinks=sinks, softcap=softcap
            )
        nd = meta.num_decodes
        if nd == q.shape[0]:
            return self.kernels.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        n = meta.native
        if n is not None and q.shape[2] in (64, 128):
            out = self.kernels.paged_prefill(
                q, k_cache, v_cache, n.block_tables, n.q_starts, n.q_lens, n.ctx_lens, scale
            )
        else:
            if meta.sdpa is None:  # q_start stays absolute
                meta.sdpa = super().prepare(meta.prefills, 0, meta.block_size, q.device)
            out = super().forward(q, k, v, k_cache, v_cache, meta.sdpa, scale)
        if nd:
            out[:nd] = self.kernels.paged_decode(
                q[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, scale
            )
        return out
