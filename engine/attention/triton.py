"""GPU attention with a Triton paged-decode kernel (``triton_decode``), which reads
K/V in place through the block tables instead of gathering them (the SDPA
backend's decode copies every block of every sequence first); prefill as in the
SDPA backend. It reads an FP8 cache in place too (e4m3 with per-head scales), where
the SDPA backend dequantizes what it gathers. Sliding windows, attention sinks and
soft-capped logits run in the kernel too (decode) and through SDPA (prefill). The
CUDA default (``attention_backend: auto``) unless flash-attn imports, and with an
FP8 cache or such layers always; tested against SDPA
under Triton's CPU interpreter in CI, and compiled on an H100 (``tests/gpu``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from splitserve.engine.attention.base import SeqSpan, decode_tables
from splitserve.engine.attention.sdpa import SdpaBackend, SdpaMetadata


@dataclass
class TritonMetadata:
    sdpa: SdpaMetadata  # prefill spans (its decode part is left empty)
    num_decodes: int
    block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    context_lens: torch.Tensor | None  # [num_decodes] int32


class TritonBackend(SdpaBackend):
    name = "triton"
    reads_fp8_kv = True  # decode in the kernel, prefill through SDPA's dequantizing gathers
    windows_and_sinks = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1)")
        from splitserve.engine.attention import triton_decode  # imports triton

        self._kernel = triton_decode
        self._num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        )

    def prepare(self, spans: list[SeqSpan], num_decodes: int, block_size: int, device: torch.device):
        if block_size & (block_size - 1):
            raise ValueError(f"the triton backend needs a power-of-two block_size, got {block_size}")
        tables = lens = None
        if num_decodes:
            tables, lens = decode_tables(spans[:num_decodes], device, torch.int32)
        prefill = super().prepare(spans[num_decodes:], 0, block_size, device)  # q_start stays absolute
        return TritonMetadata(prefill, num_decodes, tables, lens)

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: TritonMetadata,
        scale: float,
        kv_scales=None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ):
        nd = meta.num_decodes
        extra = dict(window=window, sinks=sinks, softcap=softcap)
        if nd == 0:
            return super().forward(q, k, v, k_cache, v_cache, meta.sdpa, scale, kv_scales, **extra)
        tables = meta.block_tables
        splits = self._kernel.choose_splits(nd, k_cache.shape[2], tables.shape[1], self._num_sms)
        lens = meta.context_lens
        decoded = self._kernel.paged_decode(
            q[:nd].contiguous(), k_cache, v_cache, tables, lens, scale, splits, kv_scales=kv_scales, **extra
        )
        if nd == q.shape[0]:
            return decoded
        out = super().forward(q, k, v, k_cache, v_cache, meta.sdpa, scale, kv_scales, **extra)
        out[:nd] = decoded
        return out
