"""The Triton fused-experts kernels (``kernels.triton_moe``) against the torch
grouped loop (itself checked against transformers' expert loop in
``model/test_moe.py``), run by Triton's CPU interpreter (``TRITON_INTERPRET=1``, set
by tests/conftest.py on machines without CUDA): random routing, every pair on one
expert, experts that get none, runs that are not multiples of the block, expert
ranges (as under EP), gpt-oss's biases and clamped SwiGLU, and SparseMoE layers with
the kernel set on. ``align``'s layout is checked against its definition, and shown
to read nothing back and to have shapes fixed by T * k (what a CUDA graph needs)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from splitserve.engine.capture_guard import refuse_host_syncs
from splitserve.engine.model.moe import ExpertForm, expert_rows, grouped_experts

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"),
]

E, H, INTER, K = 6, 48, 40, 2  # widths that are not powers of two


def _case(t: int, routing: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    down = torch.randn(E, H, INTER, generator=g) * 0.2
    weights = torch.rand(t, K, generator=g)
    if routing == "one_expert":
        ids = torch.full((t, K), 4)
    elif routing == "two_experts":  # the other four get none
        ids = torch.stack([torch.tensor([1, 3])[torch.randperm(2, generator=g)] for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return x, gate_up, down, weights, ids


def _gpt_oss_form(seed: int = 1) -> ExpertForm:
    g = torch.Generator().manual_seed(seed)
    return ExpertForm(
        torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g), "clamped_swiglu", 1.702, 0.5
    )


@pytest.mark.parametrize(
    "t, routing", [(1, "random"), (37, "random"), (23, "one_expert"), (19, "two_experts")]
)
@pytest.mark.parametrize("form", [None, "gpt_oss"])
def test_fused_experts_equal_the_torch_loop(t, routing, form):
    from splitserve.engine.kernels.triton_moe import fused_experts

    x, gate_up, down, weights, ids = _case(t, routing)
    form = _gpt_oss_form() if form else None
    want = grouped_experts(x, gate_up, down, weights, ids, form=form)
    got = grouped_experts(x, gate_up, down, weights, ids, kernel=fused_experts, form=form)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # an expert range (what one expert-parallel rank holds), and rows sent to it
    part = None if form is None else ExpertForm(form.gate_up_bias[2:5], form.down_bias[2:5], form.activation)
    got = grouped_experts(
        x, gate_up[2:5], down[2:5], weights, ids, first_expert=2, kernel=fused_experts, form=part
    )
    want = grouped_experts(x, gate_up[2:5], down[2:5], weights, ids, first_expert=2, form=part)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    local = ids[:, 0] % 3
    torch.testing.assert_close(
        expert_rows(x, local, gate_up[:3], down[:3], fused_experts, part),
        expert_rows(x, local, gate_up[:3], down[:3], form=part),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("tile", [(32, 128), (128, 16)])
def test_every_tile_gives_the_same_experts(tile):
    """Launch shapes (``triton_moe.Tile``: what ``gpu_bench --sweep`` times) change
    the programs, not the result: columns and depth narrower and wider than the
    widths, the gpt-oss form included."""
    from splitserve.engine.kernels.triton_moe import Tile, fused_experts

    x, gate_up, down, weights, ids = _case(21, "random", seed=2)
    for form in (None, _gpt_oss_form()):
        want = grouped_experts(x, gate_up, down, weights, ids, form=form)
        got = fused_experts(x, weights, ids, 0, gate_up, down, form, (Tile(*tile), Tile(*tile)))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_clamped_activation_clamps_in_the_kernel():
    """A limit the products exceed: the kernel's clamp is what keeps it equal."""
    from splitserve.engine.kernels.triton_moe import fused_experts

    x, gate_up, down, weights, ids = _case(29, "random", seed=4)
    loose = _gpt_oss_form()
    tight = ExpertForm(loose.gate_up_bias, loose.down_bias, "clamped_swiglu", 1.702, 0.05)
    for form in (loose, tight):
        want = grouped_experts(x * 20, gate_up, down, weights, ids, form=form)
        got = grouped_experts(x * 20, gate_up, down, weights, ids, kernel=fused_experts, form=form)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(
        grouped_experts(x * 20, gate_up, down, weights, ids, form=loose),
        grouped_experts(x * 20, gate_up, down, weights, ids, form=tight),
    )


@pytest.mark.parametrize(
    "t, routing", [(1, "random"), (37, "random"), (23, "one_expert"), (19, "two_experts")]
)
@pytest.mark.parametrize("first, held", [(0, E), (2, 3)])
def test_align_puts_each_expert_s_pairs_in_its_own_blocks(t, routing, first, held):
    """Every pair of a held expert at exactly one position, in a block of that expert,
    in pair order within the expert; nothing else anywhere; unused blocks -1; the
    count of blocks the bound ``max_blocks`` gives."""
    from splitserve.engine.kernels.triton_moe import BLOCK_M, align, max_blocks

    ids = _case(t, routing)[4]
    pairs, block_expert = align(ids, first, held)
    assert pairs.shape == (max_blocks(t * K, held) * BLOCK_M,)
    assert block_expert.shape == (max_blocks(t * K, held),)
    flat = ids.reshape(-1)
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        block = pairs[b * BLOCK_M : (b + 1) * BLOCK_M].tolist()
        if e < 0:
            assert block == [-1] * BLOCK_M
            continue
        real = [p for p in block if p >= 0]
        assert block == real + [-1] * (BLOCK_M - len(real))  # padding only at a run's end
        assert all(flat[p] == first + e for p in real)
        seen += real
    held_pairs = [p for p in range(t * K) if first <= flat[p] < first + held]
    assert sorted(seen) == held_pairs
    assert seen == sorted(held_pairs, key=lambda p: (flat[p].item(), p))
    used = [e for e in block_expert.tolist() if e >= 0]
    assert used == sorted(used) and -1 not in block_expert.tolist()[: len(used)]


def test_the_fused_path_reads_nothing_back_and_its_shapes_depend_on_t_only():
    """What a CUDA graph needs, checked on the CPU: no host read (``refuse_host_syncs``
    refuses the torch loop's ``tolist`` and passes the kernel), and the same buffers'
    shapes for any routing of the same T."""
    from splitserve.engine.capture_guard import HostSync
    from splitserve.engine.kernels.triton_moe import align, fused_experts

    x, gate_up, down, weights, ids = _case(19, "random")
    with refuse_host_syncs():
        grouped_experts(x, gate_up, down, weights, ids, kernel=fused_experts)
        grouped_experts(x, gate_up, down, weights, ids, kernel=fused_experts, form=_gpt_oss_form())
    with pytest.raises(HostSync, match="bincount"), refuse_host_syncs():
        grouped_experts(x, gate_up, down, weights, ids)
    shapes = {
        tuple(t.shape for t in align(_case(19, routing)[4], 0, E))
        for routing in ("random", "one_expert", "two_experts")
    }
    assert len(shapes) == 1


def test_a_moe_model_with_the_triton_set_computes_what_torch_does():
    from splitserve.engine.kernels import cuda
    from splitserve.engine.model.config import ModelConfig
    from splitserve.engine.model.loader import load_model
    from tests.conftest import tiny_hf_config

    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3_moe"))
    model = load_model(cfg, torch.float32, torch.device("cpu"), 64, None, seed=3)
    x = torch.randn(29, cfg.hidden_size)
    layer = model.layers[1].mlp  # layer 0 is dense
    want = layer(x)
    counted = layer.take_routed()
    layer.grouped_kernel = cuda.fused_experts
    with refuse_host_syncs():
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert layer.take_routed() == counted and sum(counted) == 29 * cfg.moe.top_k
    assert layer.take_routed() == [0] * cfg.moe.num_experts


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_decode_steps_recorded_as_graphs_keep_transformers_tokens(tmp_path, kind):
    """``cuda_graphs: true`` with MoE layers: their experts run ``fused_experts`` in
    every recorded step, whose recording passed ``refuse_host_syncs`` (off CUDA the
    recorder re-runs the step over the same buffers); greedy tokens equal
    transformers' while steps of 4, 2 and 1 rows replay, and the expert load counts
    the rows of the replayed steps."""
    from splitserve.engine.engine import Engine
    from splitserve.engine.kernels.triton_moe import fused_experts
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams
    from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
    from tests.unit.engine.attention.test_triton_decode import count_replays

    hf = make_hf_checkpoint(kind, tmp_path)
    prompts = random_prompts([5, 40, 23, 12], 512, seed=7)
    max_tokens = [6, 3, 9, 1]
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens)]
    engine = Engine(
        EngineConfig(
            model=str(tmp_path),
            dtype="float32",
            attention_backend="triton",
            cuda_graphs=True,
            num_kv_blocks=64,
            max_num_seqs=4,
            max_model_len=256,
        )
    )
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    assert all(m.grouped_kernel is fused_experts for m in engine.model.moe_layers())
    for m in engine.model.moe_layers():
        m.take_routed()  # the recordings' own runs
    replays = count_replays(graphs)
    out = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens])
    assert [o.token_ids for o in out] == expected
    assert replays[4] > 0 and replays[2] > 0 and replays[1] > 0
    layer = engine.model.moe_layers()[0]
    prefilled = sum(len(p) for p in prompts)
    replayed_rows = sum(b * n for b, n in replays.items())
    assert sum(layer.take_routed()) == (prefilled + replayed_rows) * engine.model_config.moe.top_k


def test_recording_a_moe_step_with_the_torch_loop_is_refused(tmp_path, monkeypatch):
    """Without ``fused_experts`` the experts read their row counts on the host: the
    off-CUDA recorder refuses that step as a capture would."""
    from splitserve.engine import build
    from splitserve.engine.capture_guard import HostSync
    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from tests.conftest import tiny_hf_config

    monkeypatch.setattr(build, "_experts_for_graphs", lambda model: None)
    config = EngineConfig(
        model="x",
        random_weights=True,
        dtype="float32",
        attention_backend="triton",
        cuda_graphs=True,
        num_kv_blocks=16,
        max_num_seqs=1,
        max_model_len=64,
    )
    with pytest.raises(HostSync, match="a CUDA graph cannot capture it"):
        Engine(config, hf_config=tiny_hf_config("qwen3_moe"))


def test_the_guard_refuses_only_its_own_thread_s_host_reads():
    """Another thread's ``tolist`` (a worker's poller, say) is not a capture's."""
    import threading

    from splitserve.engine.capture_guard import HostSync

    got = []
    with refuse_host_syncs():
        other = threading.Thread(target=lambda: got.append(torch.arange(3).tolist()))
        other.start()
        other.join(30)
        with pytest.raises(HostSync, match="tolist"):
            torch.arange(3).tolist()
    assert got == [[0, 1, 2]] and torch.arange(2).tolist() == [0, 1]
