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


fused_bf16 = pytest.mark.skipif(native is None or not native.has_fused_bf16(), reason="needs AVX-512")


@fused_bf16
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_and_cache_equals_the_torch_ops(head_dim):
    """Bit for bit what ``Attention._rope_and_cache`` computes in bf16 torch ops: the
    rotated q and k, and k and v at their cache slots (and nothing else written)."""
    from splitserve.engine.model.config import ModelConfig
    from splitserve.engine.model.llama import Attention
    from splitserve.engine.model.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(4)
    heads, kv_heads, T, blocks, bs = 6, 2, 37, 8, 16
    cfg = ModelConfig(
        model_type="llama", vocab_size=32, hidden_size=heads * head_dim, intermediate_size=64, num_layers=1,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    attn = Attention(cfg)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).bfloat16() * 4
    positions = torch.randint(0, 4096, (T,), generator=g)
    cos, sin = RotaryEmbedding(head_dim, cfg.rope, 4096).tables(positions, qkv.dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    caches = [torch.zeros(blocks, bs, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(4)]
    want = attn._rope_and_cache(qkv, cos, sin, caches[0], caches[1], slots)
    got = native.rope_and_cache(qkv, cos, sin, caches[2], caches[3], slots, heads, kv_heads)
    for w, x in zip(want, got):
        assert torch.equal(w, x)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].flatten(0, 1).abs().sum(dim=(1, 2)).count_nonzero() == T  # only the T slots written


@fused_bf16
def test_silu_mul_equals_the_torch_ops():
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(19, 2 * 96, generator=g) * 6).bfloat16()  # large |x|: both sigmoid branches
    gate, up = gate_up.split(96, dim=-1)
    want = F.silu(gate) * up
    got = native.silu_mul(gate_up)
    # torch's exp and ours may round a value to neighbouring bf16 numbers (one unit in the last place)
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 49152, 1000])  # under one vector; many; a tail after the vectors
def test_argmax_rows_equals_torch_argmax(dtype, vocab):
    """Including ties (the first index wins, as in torch) and a row of -inf."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randint(-50, 50, (9, vocab), generator=g).to(dtype)  # small integers: many ties
    logits[3] = float("-inf")
    logits[4, vocab // 2 :] = 1000.0  # the max repeated over the second half
    torch.testing.assert_close(native.argmax_rows(logits), logits.argmax(dim=-1), rtol=0, atol=0)
