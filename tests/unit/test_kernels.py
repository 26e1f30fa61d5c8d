"""Native CPU kernels against plain-torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine import kernels
from splitserve.engine.model.llama import RMSNorm

native = kernels.load()
pytestmark = pytest.mark.skipif(native is None, reason="native CPU kernels did not build")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [96, 100])  # 100: not a multiple of 16 (the bf16 vector path's unit)
def test_add_rms_norm_matches_torch(dtype, dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, dim, generator=g).to(dtype)
    delta = torch.randn(37, dim, generator=g).to(dtype)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = torch.randn(dim, generator=g).to(dtype)
    x_ref, x_nat = x.clone(), x.clone()
    ref = norm(x_ref, delta)  # eager path: x_ref += delta, then normalise
    out = native.add_rms_norm(x_nat, delta, norm.weight, 1e-5)
    torch.testing.assert_close(x_nat, x_ref)  # the residual stream is updated identically
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(
        native.add_rms_norm(x.clone(), None, norm.weight, 1e-5), norm(x.clone()), **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 32])  # 32 takes the portable C++ path
@pytest.mark.parametrize("group", [4, 3])  # query heads per KV head (SmolLM2: 3)
def test_paged_decode_matches_sdpa(dtype, head_dim, group):
    g = torch.Generator().manual_seed(2)
    seqs, kv_heads, blocks, bs = 5, 2, 40, 16
    heads = kv_heads * group
    k_cache = torch.randn(blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor([1, 17, 48, 63, 100])  # partial and whole blocks, 16-token runs and single tokens
    table = torch.randperm(blocks, generator=g)[: seqs * 7].view(seqs, 7)
    q = torch.randn(seqs, heads, head_dim, generator=g).to(dtype)
    out = native.paged_decode(q, k_cache, v_cache, table, lens, head_dim**-0.5)
    for s in range(seqs):
        n = int(lens[s])
        k = k_cache[table[s]].reshape(-1, kv_heads, head_dim)[:n].float().repeat_interleave(group, dim=1)
        v = v_cache[table[s]].reshape(-1, kv_heads, head_dim)[:n].float().repeat_interleave(group, dim=1)
        ref = F.scaled_dot_product_attention(q[s].float()[:, None], k.transpose(0, 1), v.transpose(0, 1))
        torch.testing.assert_close(out[s].float(), ref[:, 0], **TOL[dtype])


@pytest.mark.skipif(native is None or not native.has_paged_prefill(), reason="needs AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [3, 4])
def test_paged_prefill_matches_causal_sdpa(dtype, head_dim, group):
    """Chunks after a cached prefix and fresh prompts, each against float32 SDPA with
    the bottom-right causal mask, over randomly placed blocks."""
    g = torch.Generator().manual_seed(3)
    kv_heads, blocks, bs = 2, 64, 16
    heads = kv_heads * group
    k_cache = torch.randn(blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    # (new tokens, tokens in cache after the step): fresh prompts of 1, 33 and 100
    # tokens (tiles of 32 plus a rest), a chunk of 50 after 47 cached, one token after 16
    spans = [(1, 1), (33, 33), (50, 97), (100, 100), (1, 17)]
    table = torch.randperm(blocks, generator=g)[: len(spans) * 7].view(len(spans), 7)
    q_lens = torch.tensor([n for n, _ in spans])
    ctx_lens = torch.tensor([c for _, c in spans])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    q = torch.randn(int(q_lens.sum()), heads, head_dim, generator=g).to(dtype)
    out = native.paged_prefill(q, k_cache, v_cache, table, q_starts, q_lens, ctx_lens, head_dim**-0.5)
    for s, (n, ctx) in enumerate(spans):
        k = k_cache[table[s]].reshape(-1, kv_heads, head_dim)[:ctx].float().repeat_interleave(group, dim=1)
        v = v_cache[table[s]].reshape(-1, kv_heads, head_dim)[:ctx].float().repeat_interleave(group, dim=1)
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        qs = q[int(q_starts[s]) : int(q_starts[s]) + n].float().transpose(0, 1)
        ref = F.scaled_dot_product_attention(qs, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        got = out[int(q_starts[s]) : int(q_starts[s]) + n].float()
        torch.testing.assert_close(got, ref.transpose(0, 1), **TOL[dtype])
