"""flash-attn backend against the SDPA backend on the same paged cache (CUDA and
the flash_attn package required; skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.attention import SeqSpan, flash_attn_available, get_backend

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_attn_available(torch.device("cuda"))),
    reason="needs CUDA and the flash_attn package",
)


@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_matches_sdpa_on_mixed_batch(block_size):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    heads, kv_heads, dim, num_blocks = 8, 2, 64, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()
    # Two decodes, one fresh prompt, one chunk after a cached prefix.
    ctx = [40, 300, 50, 120]
    q_lens = [1, 1, 50, 30]
    spans, start, used = [], 0, 0
    for c, ql in zip(ctx, q_lens):
        nb = -(-c // block_size)
        spans.append(SeqSpan(start, ql, c, perm[used : used + nb]))
        used += nb
        start += ql
    q = torch.randn(start, heads, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(start, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for s in spans:  # the layer writes this step's K/V before attention
        for i in range(s.q_len):
            pos = s.ctx_len - s.q_len + i
            blk, off = s.block_table[pos // block_size], pos % block_size
            k_cache[blk, off] = k[s.q_start + i]
            v_cache[blk, off] = v[s.q_start + i]
    outs = {}
    for name in ("sdpa", "flash_attn"):
        backend = get_backend(name, dev)
        meta = backend.prepare(spans, 2, block_size, dev)
        outs[name] = backend.forward(q, k, v, k_cache, v_cache, meta, dim**-0.5).float()
    torch.testing.assert_close(outs["flash_attn"], outs["sdpa"], atol=2e-2, rtol=2e-2)
