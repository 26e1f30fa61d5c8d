"""The Triton paged-decode kernel against the SDPA backend, run by Triton's CPU
interpreter (``TRITON_INTERPRET=1``, which tests/conftest.py sets for the whole
run on machines without CUDA, before anything imports triton), so CI checks the
kernel's arithmetic without a GPU. Skipped when triton is not installed;
tests/gpu runs it compiled for CUDA."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"),
]

CPU = torch.device("cpu")


def paged_case(ctx_lens, heads, kv_heads, dim, block=16, q_lens=None, seed=0):
    """Random paged caches, shuffled block tables, this step's K/V already written."""
    g = torch.Generator().manual_seed(seed)
    q_lens = q_lens or [1] * len(ctx_lens)
    need = sum(-(-c // block) for c in ctx_lens)
    k_cache = torch.randn(need + 3, block, kv_heads, dim, generator=g)
    v_cache = torch.randn(need + 3, block, kv_heads, dim, generator=g)
    perm = torch.randperm(need + 3, generator=g).tolist()
    spans, start, used = [], 0, 0
    from splitserve.engine.attention import SeqSpan

    for c, ql in zip(ctx_lens, q_lens):
        nb = -(-c // block)
        spans.append(SeqSpan(start, ql, c, perm[used : used + nb]))
        used += nb
        start += ql
    q = torch.randn(start, heads, dim, generator=g)
    k = torch.randn(start, kv_heads, dim, generator=g)
    v = torch.randn(start, kv_heads, dim, generator=g)
    for s in spans:
        for i in range(s.q_len):
            pos = s.ctx_len - s.q_len + i
            k_cache[s.block_table[pos // block], pos % block] = k[s.q_start + i]
            v_cache[s.block_table[pos // block], pos % block] = v[s.q_start + i]
    return q, k, v, k_cache, v_cache, spans


def run(name, case, num_decodes, block=16):
    from splitserve.engine.attention import get_backend

    q, k, v, k_cache, v_cache, spans = case
    backend = get_backend(name, CPU)
    meta = backend.prepare(spans, num_decodes, block, CPU)
    return backend.forward(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5)


@pytest.mark.parametrize(
    "ctx_lens, heads, kv_heads, dim",
    [
        ([1, 17, 300, 64], 8, 2, 64),  # GQA group 4; a one-token context; exact and partial blocks
        ([40, 5], 4, 4, 128),  # no GQA
        ([33], 6, 2, 80),  # group 3 and head_dim 80: both padded inside the kernel
    ],
)
def test_paged_decode_matches_sdpa(ctx_lens, heads, kv_heads, dim):
    case = paged_case(ctx_lens, heads, kv_heads, dim)
    torch.testing.assert_close(run("triton", case, len(ctx_lens)), run("sdpa", case, len(ctx_lens)))


@pytest.mark.parametrize("splits", [1, 3, 8, 40])
def test_every_split_count_gives_the_same_attention(splits):
    """More splits than a sequence has blocks leave some splits empty: they must weigh 0."""
    from splitserve.engine.attention.triton_decode import paged_decode

    q, _, _, k_cache, v_cache, spans = paged_case([1, 70, 250], 8, 2, 64)
    width = max(len(s.block_table) for s in spans)
    tables = torch.tensor(
        [s.block_table + [0] * (width - len(s.block_table)) for s in spans], dtype=torch.int32
    )
    lens = torch.tensor([s.ctx_len for s in spans], dtype=torch.int32)
    one = paged_decode(q, k_cache, v_cache, tables, lens, 0.125, 1)
    torch.testing.assert_close(paged_decode(q, k_cache, v_cache, tables, lens, 0.125, splits), one)


def fp8_case(ctx_lens, heads, kv_heads, dim, seed=0, q_lens=None):
    """``paged_case`` with its caches in e4m3 and power-of-two scales per KV head (as the
    engine calibrates them); the fresh K/V as the cache holds them."""
    from splitserve.engine.kv_quant import calibrated_scales, dequantize, quantize

    q, k, v, k_cache, v_cache, spans = paged_case(ctx_lens, heads, kv_heads, dim, q_lens=q_lens, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    k_cache = k_cache * torch.rand(kv_heads, 1, generator=g) * 8  # heads of different ranges
    scales = calibrated_scales(k_cache.flatten(0, 1), v_cache.flatten(0, 1))
    k8 = quantize(k_cache.flatten(0, 1), scales[0]).view(k_cache.shape)
    v8 = quantize(v_cache.flatten(0, 1), scales[1]).view(v_cache.shape)
    k, v = (dequantize(quantize(t, s), s, t.dtype) for t, s in ((k, scales[0]), (v, scales[1])))
    return (q, k, v, k8, v8, spans), scales


@pytest.mark.parametrize(
    "ctx_lens, heads, kv_heads",
    [
        ([1, 17, 300, 64], 8, 8),  # GQA group 1
        ([40, 5, 129], 8, 2),  # group 4
        ([33, 250], 16, 2),  # group 8
    ],
)
def test_paged_decode_reads_an_fp8_cache_as_sdpa_dequantizes_it(ctx_lens, heads, kv_heads):
    from splitserve.engine.attention import get_backend

    (q, k, v, k8, v8, spans), scales = fp8_case(ctx_lens, heads, kv_heads, 64)
    assert k8.dtype == torch.float8_e4m3fn
    got, want = (
        backend.forward(q, k, v, k8, v8, backend.prepare(spans, len(spans), 16, CPU), 0.125, scales)
        for backend in (get_backend("triton", CPU), get_backend("sdpa", CPU))
    )
    torch.testing.assert_close(got, want)
    # the scales are applied: the same bytes read as if every scale were 1 differ
    ones = torch.ones_like(scales)
    meta = get_backend("sdpa", CPU).prepare(spans, len(spans), 16, CPU)
    unscaled = get_backend("sdpa", CPU).forward(q, k, v, k8, v8, meta, 0.125, ones)
    assert not torch.allclose(unscaled, want, atol=1e-2)


@pytest.mark.parametrize("splits", [1, 5, 40])
def test_fp8_decode_gives_the_same_attention_for_every_split_count(splits):
    """Splits past a short sequence's end (40 for a 1-token context) see no keys."""
    from splitserve.engine.attention.triton_decode import paged_decode

    (q, _, _, k8, v8, spans), scales = fp8_case([1, 70, 250], 8, 2, 64)
    width = max(len(s.block_table) for s in spans)
    tables = torch.tensor(
        [s.block_table + [0] * (width - len(s.block_table)) for s in spans], dtype=torch.int32
    )
    lens = torch.tensor([s.ctx_len for s in spans], dtype=torch.int32)
    one = paged_decode(q, k8, v8, tables, lens, 0.125, 1, kv_scales=scales)
    got = paged_decode(q, k8, v8, tables, lens, 0.125, splits, kv_scales=scales)
    torch.testing.assert_close(got, one)
    with pytest.raises(ValueError, match="FP8 KV cache needs its kv_scales"):
        paged_decode(q, k8, v8, tables, lens, 0.125, splits)


def test_fp8_mixed_batch_decodes_and_prefills():
    from splitserve.engine.attention import get_backend

    (q, k, v, k8, v8, spans), scales = fp8_case([50, 120, 30, 90], 8, 2, 64, q_lens=[1, 1, 30, 20])
    got, want = (
        backend.forward(q, k, v, k8, v8, backend.prepare(spans, 2, 16, CPU), 0.125, scales)
        for backend in (get_backend("triton", CPU), get_backend("sdpa", CPU))
    )
    torch.testing.assert_close(got, want)


def test_engine_with_an_fp8_cache_on_the_triton_backend_equals_sdpa(tmp_path):
    """Same greedy tokens as the SDPA backend reading the same FP8 cache."""
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams
    from tests.conftest import make_hf_checkpoint, random_prompts

    make_hf_checkpoint("llama", tmp_path)
    prompts = random_prompts([5, 40, 77], 512)
    outs = {}
    for name in ("sdpa", "triton"):
        engine = Engine(
            EngineConfig(
                model=str(tmp_path),
                dtype="float32",
                attention_backend=name,
                num_kv_blocks=64,
                kv_cache_dtype="fp8",
            )
        )
        assert engine.runner.backend.name == name and engine.kv_cache.scales is not None
        out = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        outs[name] = [o.token_ids for o in out]
    assert outs["triton"] == outs["sdpa"]


def test_mixed_batch_decodes_and_prefills():
    case = paged_case([50, 120, 30, 90], 8, 2, 64, q_lens=[1, 1, 30, 20])  # 2 decodes, a prompt, a chunk
    torch.testing.assert_close(run("triton", case, 2), run("sdpa", case, 2))


def test_engine_with_the_triton_backend_equals_hf(tmp_path):
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams
    from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

    hf = make_hf_checkpoint("llama", tmp_path)
    prompts = random_prompts([5, 40, 77], 512)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    engine = Engine(
        EngineConfig(model=str(tmp_path), dtype="float32", attention_backend="triton", num_kv_blocks=64)
    )
    assert engine.runner.backend.name == "triton"
    out = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in out] == expected


def test_refused_without_cuda_or_the_interpreter(monkeypatch):
    from splitserve.engine.attention import get_backend

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("triton", CPU)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_gpu_bench_decode_step_runs_the_kernel(kv_dtype):
    """The benchmark's decode step with the Triton backend, over its bf16 and its FP8
    cache: the same logits as with SDPA."""
    from splitserve.bench import gpu_bench as gb

    cfg = gb.model_config("tiny")
    model = gb.build(cfg, "none", CPU)
    logits = {}
    for attention in ("sdpa", "triton"):
        torch.manual_seed(0)
        cache = gb._kv_cache(cfg, 8, CPU, kv_dtype)
        assert (cache.scales is not None) == (kv_dtype == "fp8")
        assert not cache.tensor.float().isnan().any()
        spans = [gb.SeqSpan(0, 1, 40, [0, 1, 2]), gb.SeqSpan(1, 1, 17, [5, 6])]
        step = gb._step(model, cache, spans, 2, [3, 4], [39, 16], [2 * 16 + 7, 6 * 16], attention)
        logits[attention] = step().float()
    torch.testing.assert_close(logits["triton"], logits["sdpa"], atol=2e-2, rtol=2e-2)


def count_replays(graphs) -> dict[int, int]:
    """Wrap each of ``graphs``' replays (a ``DecodeGraphs``) to count its calls: the
    returned dict, by batch size, counts from now on."""
    replays = {b: 0 for b in graphs.sizes}
    for b, replay in list(graphs.replays.items()):

        def counted(b=b, replay=replay):
            replays[b] += 1
            return replay()

        graphs.replays[b] = counted
    return replays


def test_engine_with_decode_graphs_equals_hf(tmp_path):
    """``cuda_graphs``: pure-decode steps go through the static buffers, padded to the
    next recorded batch size (off CUDA the "recording" re-runs; the buffer logic is the
    same). 7 sequences of different lengths finish at different steps, so the batch
    crosses several sizes (7 -> 8 rows, then 4, 2, 1), and prefill steps run eagerly."""
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams
    from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

    hf = make_hf_checkpoint("llama", tmp_path)
    prompts = random_prompts([5, 40, 77, 12, 30, 9, 64], 512, seed=5)
    max_tokens = [3, 12, 7, 1, 9, 5, 10]
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens)]
    engine = Engine(
        EngineConfig(
            model=str(tmp_path),
            dtype="float32",
            attention_backend="triton",
            cuda_graphs=True,
            num_kv_blocks=64,
            max_num_seqs=8,
            max_model_len=256,
        )
    )
    graphs = engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8] and graphs.scratch_block == 63
    assert engine.block_manager.num_blocks == 63  # the scratch block is never handed out
    replays = count_replays(graphs)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    out = engine.generate(prompts, params)
    assert [o.token_ids for o in out] == expected
    assert replays[8] > 0 and replays[2] > 0 and replays[1] > 0  # several sizes were replayed


def test_decode_graphs_are_refused_with_another_backend_or_tp():
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from tests.conftest import tiny_hf_config

    with pytest.raises(ValueError, match="triton attention backend"):
        Engine(
            EngineConfig(model="x", random_weights=True, attention_backend="sdpa", cuda_graphs=True),
            hf_config=tiny_hf_config("llama"),
        )


def speculating_with_graphs(
    tmp_path, device: str, max_num_seqs: int, max_len: int, max_tokens: int, seed: int = 1, **spec
):
    """Greedy runs of three prompts on an engine with decode graphs that speculates
    with an oracle proposer (transformers' own next tokens): (the engine, its
    tokens, transformers' tokens, the rows of every graph replay). Shared with
    tests/gpu (device "cuda")."""
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams
    from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
    from tests.unit.engine.speculative.test_verification import Oracle

    hf = make_hf_checkpoint("llama", tmp_path)
    prompts = random_prompts([5, 40, 77], max_len, seed=seed)  # token ids below max_len
    expected = [hf_greedy(hf, p, max_tokens) for p in prompts]
    engine = Engine(
        EngineConfig(
            model=str(tmp_path),
            dtype="float32",
            device=device,
            attention_backend="triton",
            cuda_graphs=True,
            max_num_seqs=max_num_seqs,
            max_model_len=max_len,
            num_kv_blocks=max_len // 4,
            speculative={"method": "ngram", "num_tokens": 3, **spec},
        )
    )
    engine.speculation.proposer = Oracle(prompts, expected, max_len)
    replayed, run = [], engine.runner.graphs.run
    engine.runner.graphs.run = lambda ids, *rest: replayed.append(len(ids)) or run(ids, *rest)
    out = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return engine, [o.token_ids for o in out], expected, replayed


def test_decode_graphs_hold_the_rows_of_a_verification_step(tmp_path):
    """Speculating with ``cuda_graphs``, a step's drafts are decode rows
    (``spread_drafts``): the recordings reach ``max_num_seqs x (1 + num_tokens)``
    rows (4 x 4 = 16 here), steps with drafts replay them, and the tokens are
    transformers' (off CUDA the "recording" re-runs over the same buffers)."""
    engine, tokens, expected, replayed = speculating_with_graphs(
        tmp_path, "cpu", 4, 256, 12, seed=6, adaptive=False
    )
    assert engine.runner.spread_drafts and engine.runner.graphs.sizes == [1, 2, 4, 8, 16]
    assert tokens == expected
    assert engine.stats().speculation.accepted_tokens > 0
    assert max(replayed) > 3, replayed  # a step with drafts replayed a recording (3 sequences)


@pytest.mark.parametrize(
    "window, sinks, softcap",
    [
        (20, False, None),  # a window: contexts shorter, longer and far longer than it
        (None, True, None),  # attention sinks alone
        (33, True, None),  # gpt-oss: both
        (None, False, 2.0),  # Gemma 2: soft-capped logits (a cap that bites)
        (16, False, 2.0),  # its sliding layers: both
    ],
)
@pytest.mark.parametrize("splits", [1, 6])
def test_windows_sinks_and_soft_caps_decode_as_sdpa(window, sinks, softcap, splits):
    """The kernel against the SDPA backend (masks, a sink key, capped logits in float32),
    with a split count that leaves splits wholly before a window (they weigh nothing)."""
    from splitserve.engine.attention import get_backend
    from splitserve.engine.attention.triton_decode import paged_decode

    q, k, v, k_cache, v_cache, spans = paged_case([1, 17, 40, 300], 8, 2, 64, seed=3)
    head_sinks = torch.randn(8, generator=torch.Generator().manual_seed(9)) if sinks else None
    extra = dict(window=window, sinks=head_sinks, softcap=softcap)
    sdpa = get_backend("sdpa", CPU)
    want = sdpa.forward(q, k, v, k_cache, v_cache, sdpa.prepare(spans, 4, 16, CPU), 0.125, **extra)
    width = max(len(s.block_table) for s in spans)
    tables = torch.tensor(
        [s.block_table + [0] * (width - len(s.block_table)) for s in spans], dtype=torch.int32
    )
    lens = torch.tensor([s.ctx_len for s in spans], dtype=torch.int32)
    got = paged_decode(q, k_cache, v_cache, tables, lens, 0.125, splits, **extra)
    torch.testing.assert_close(got, want)
    plain = sdpa.forward(q, k, v, k_cache, v_cache, sdpa.prepare(spans, 4, 16, CPU), 0.125)
    assert not torch.allclose(got, plain, atol=1e-3)  # what was asked for changed the attention


def test_a_window_reads_no_block_before_it():
    """A table whose entries before the window name blocks full of NaN (a layer group's
    given-back blocks, read as its first) decodes as if those keys were not there."""
    from splitserve.engine.attention.triton_decode import paged_decode

    q, k, v, k_cache, v_cache, spans = paged_case([300], 8, 2, 64, seed=4)
    tables = torch.tensor([spans[0].block_table], dtype=torch.int32)
    lens = torch.tensor([300], dtype=torch.int32)
    want = paged_decode(q, k_cache, v_cache, tables, lens, 0.125, 4, window=40)
    poisoned = k_cache.clone(), v_cache.clone()
    for b in spans[0].block_table[: (300 - 40) // 16]:
        poisoned[0][b] = float("nan")
        poisoned[1][b] = float("nan")
    got = paged_decode(q, *poisoned, tables, lens, 0.125, 4, window=40)
    torch.testing.assert_close(got, want)


def test_engine_with_a_sliding_window_model_on_the_triton_backend_equals_hf(tmp_path):
    """gpt-oss (sliding and full layers in layer groups, sinks) on the triton backend:
    transformers' greedy tokens, prompts past its 16-token window."""
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams
    from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

    hf = make_hf_checkpoint("gpt_oss", tmp_path)
    prompts = random_prompts([5, 40, 77], 512)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    engine = Engine(
        EngineConfig(
            model=str(tmp_path), dtype="float32", attention_backend="triton", num_kv_blocks=96, block_size=4
        )
    )
    assert engine.runner.backend.name == "triton" and engine.kv_cache.layout.grouped
    out = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in out] == expected
