"""Gated DeltaNet (``engine.model.deltanet``) against transformers' own layers.

transformers' Qwen3-Next and Qwen3.5 linear-attention layers (random weights, float32)
run a whole sequence at once; ours runs the same weights over the same tokens in
pieces, as an engine schedules them: a prompt in two prefill chunks (the second
not a multiple of the 64-token chunk), then one token per step, beside a second
sequence in other slots in the same steps. The outputs must equal the reference's
rows, so the convolution and recurrent states carry across steps exactly (each
step reading a sequence's state from one slot and writing the next to another,
so a step run again gives the same), and the two sequences never touch each
other's state.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.model.deltanet import (
    DeltaShape,
    DeltaSpan,
    DeltaStates,
    GatedDeltaNet,
    as_ours,
    chunked_delta_rule,
    recurrent_delta_rule,
)


def reference_layer(kind: str, seed: int):
    torch.manual_seed(seed)
    common = dict(
        hidden_size=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as Layer

        cfg = Qwen3NextConfig(**common)
    else:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as Layer

        cfg = Qwen3_5TextConfig(**common)
    layer = Layer(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():  # weights large enough that every term matters
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.rand_like(layer.A_log) - 1.0)
    shape = DeltaShape(64, 2, 4, 16, 8, 4, cfg.rms_norm_eps)
    ours = GatedDeltaNet(shape, fused=kind == "qwen3_next")
    ours.load_state_dict(as_ours(layer.state_dict()))
    return layer, ours, shape


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_sequence_in_pieces_equals_transformers_over_it_whole(kind, seed):
    layer, ours, shape = reference_layer(kind, seed)
    g = torch.Generator().manual_seed(seed + 10)
    a, b = torch.randn(1, 150, 64, generator=g), torch.randn(1, 40, 64, generator=g)
    with torch.no_grad():
        want_a = layer(a)[0]
    states = DeltaStates.empty(5, shape.conv_channels, 4, 4, 16, 8, torch.float32)
    slots = {"a": [3, 4], "b": [0, 1]}  # each sequence's state, and where a step writes the next

    def span(name: str, start: int, length: int, fresh: bool = False) -> DeltaSpan:
        return DeltaSpan(start, length, *slots[name], fresh)

    def ran(*names: str) -> None:  # the step succeeded: the written states are the sequences' now
        for n in names:
            slots[n].reverse()

    got_a, got_b = [], []
    with torch.no_grad():
        # step 1: a's first 70 tokens; step 2: a's next 50 and all of b
        got_a.append(ours(a[0, :70], [span("a", 0, 70, fresh=True)], states))
        ran("a")
        step = ours(
            torch.cat([a[0, 70:120], b[0]]), [span("a", 0, 50), span("b", 50, 40, fresh=True)], states
        )
        ran("a", "b")
        got_a.append(step[:50])
        got_b.append(step[50:])
        # then a one token a step, batched with b's continuation in the same steps; a step
        # run twice (a failed one run again) gives the same, from the same states
        b_more = torch.randn(1, 30, 64, generator=g)
        want_b = layer(torch.cat([b, b_more], dim=1))[0]
        for i in range(30):
            x = torch.stack([b_more[0, i], a[0, 120 + i]])
            out = ours(x, [span("b", 0, 1), span("a", 1, 1)], states)
            if i % 7 == 0:
                torch.testing.assert_close(ours(x, [span("b", 0, 1), span("a", 1, 1)], states), out)
            ran("a", "b")
            got_b.append(out[:1])
            got_a.append(out[1:])
    torch.testing.assert_close(torch.cat(got_a), want_a, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got_b), want_b, atol=2e-4, rtol=1e-4)
    assert not states.recurrent[2].any() and not states.conv[2].any()  # the slot nobody used


def test_the_chunked_and_recurrent_forms_agree_from_a_state():
    g = torch.Generator().manual_seed(3)
    length, heads, dk, dv = 131, 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
    v = torch.randn(length, heads, dv, generator=g)
    decay = -torch.rand(length, heads, generator=g)
    beta = torch.rand(length, heads, generator=g)
    start = torch.randn(heads, dk, dv, generator=g)
    chunked_state = start.clone()
    chunked = chunked_delta_rule(q, k, v, decay, beta, chunked_state, chunk=16)
    step_state = start.clone()[None]
    stepped = torch.cat(
        [
            recurrent_delta_rule(
                q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], step_state
            )
            for t in range(length)
        ]
    )
    torch.testing.assert_close(chunked, stepped, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked_state, step_state[0], atol=1e-4, rtol=1e-4)
