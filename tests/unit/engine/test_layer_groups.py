"""Layer groups: a sliding-window model's sliding layers hold only their window's KV.

``KVLayout.grouped``: the full layers and each group of as many sliding layers
share the cache's rows, a block in one group at a time; a sequence holds the full
layers' blocks and, per sliding group, only the blocks its window still reaches
(``BlockManager``). Checked here: the layout's arithmetic; a tiny random gpt-oss
(4 layers, sliding and full alternating, a 16-token window, 4-token blocks)
holding at most the window and one block per sliding group after every step of a
chunked prompt and its decode, with transformers' greedy tokens; cached prefixes
found only with their windows (and then given), also after those blocks were given
back; what does not run with layer groups yet refused with a sentence.
"""

from __future__ import annotations

import pytest
from transformers import GptOssConfig

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.engine import Engine
from splitserve.engine.sequence import Sequence
from splitserve.wire.config import EngineConfig, SpeculativeConfig
from splitserve.wire.kv_layout import KVLayout
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts

BS, WINDOW = 4, 16


def test_the_layout_puts_every_layer_in_its_own_row_of_its_group():
    """gpt-oss's alternation (two groups of 12 rows) and a Gemma 3 like 5:1 with a short
    last group: each (group, row) holds one layer, the full layers are group 0, and a
    transfer's flat ids split back into each layer's part."""
    gpt = KVLayout(
        24, 8, BS, 2, 8, "bfloat16", windows=tuple(128 if i % 2 == 0 else 0 for i in range(24)), grouped=True
    )
    gemma = KVLayout(
        26, 8, BS, 2, 8, "bfloat16", windows=tuple(0 if i % 6 == 5 else 512 for i in range(26)), grouped=True
    )
    assert (gpt.rows, gpt.window_groups, gemma.rows, gemma.window_groups) == (12, 1, 4, 6)
    assert (gpt.most_ids(10), gpt.most_ids(100)) == (20, 100 + 128 // BS + 1)  # a staging sink's room
    for lay in (gpt, gemma):
        places = [(lay.group(i), lay.row(i)) for i in range(lay.num_layers)]
        assert len(set(places)) == lay.num_layers and all(r < lay.rows for _, r in places)
        assert all((lay.group(i) == 0) == (not lay.windowed(i)) for i in range(lay.num_layers))
        assert lay.cache_shape[0] == lay.rows
        full, wf = list(range(10)), 7
        windows = [[100 * (g + 1) + j for j in range(3)] for g in range(lay.window_groups)]
        ids = lay.transfer_ids(full, windows, wf)
        assert lay.token_blocks(len(ids), wf) == 10
        for i in range(lay.num_layers):
            g = lay.group(i)
            assert lay.layer_blocks(i, ids, wf) == (full if g == 0 else windows[g - 1])
        with pytest.raises(ValueError):
            lay.token_blocks(len(ids) + 1, wf)
    with pytest.raises(ValueError, match="both sliding and full"):
        KVLayout(2, 8, BS, 2, 8, "bfloat16", windows=(16, 16), grouped=True)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt_oss")
    return directory, make_hf_checkpoint("gpt_oss", directory)


def engine_of(directory, **kw) -> Engine:
    cfg = dict(model=str(directory), dtype="float32", block_size=BS, num_kv_blocks=96)
    return Engine(EngineConfig(**{**cfg, **kw}))


def held_per_group(engine: Engine) -> list[int]:
    """The blocks each running sequence's sliding groups hold, every group, all sequences."""
    return [len(t) for state in engine.requests.values() for t in state.seq.window_tables]


def test_a_chunked_prompt_and_its_decode_hold_the_window_and_one_block(gpt_oss):
    directory, hf = gpt_oss
    (prompt,) = random_prompts([150], 512, seed=3)
    engine = engine_of(directory, max_num_batched_tokens=24)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    tokens, most = [], 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens.extend(o.new_token_ids)
        if engine.requests:
            seq = engine.requests[rid].seq
            # every block the engine holds is the sequence's: its full ones and its windows
            assert engine.block_manager.num_used_blocks == len(seq.block_table) + sum(held_per_group(engine))
            assert seq.window_start == max(0, seq.num_computed_tokens - WINDOW + 1) // BS
            most = max(most, *held_per_group(engine))
    assert most == WINDOW // BS + 1  # the window and one block, reached and never passed
    assert tokens == hf_greedy(hf, prompt, 20)
    assert engine.block_manager.num_used_blocks == 0


def test_a_prefix_is_cached_with_its_windows_given_back_mid_prompt(gpt_oss):
    """The first prompt computes in chunks, each step giving back the sliding blocks it
    left behind, registered first: a later prompt sharing its first 60 tokens finds the
    full blocks and its window's, takes them, and gives transformers' tokens."""
    directory, hf = gpt_oss
    (first,) = random_prompts([120], 512, seed=4)
    second = first[:60] + random_prompts([30], 512, seed=5)[0]
    engine = engine_of(directory, max_num_batched_tokens=16)
    engine.generate([first], SamplingParams(max_tokens=4, ignore_eos=True))
    out = engine.generate([second], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.num_cached_tokens == 60
    assert out.token_ids == hf_greedy(hf, second, 8)


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(max_tokens=1))


def test_a_prefix_whose_window_blocks_were_reused_is_found_only_up_to_its_windows():
    """Block-manager level, every block counted: a finished sequence A of 16 blocks (its
    sliding blocks out of its last window given back as it computed); B takes A's first
    8 blocks with their window and lets them go later than the rest; a filler then reuses
    the 12 blocks given back first: A's later sliding blocks. A prompt with all of A's
    16 full blocks cached is given only the 8 whose window is still cached, and those
    windows' very blocks."""
    bm = BlockManager(32, BS, window=8, window_groups=1)  # a window reaches 2 blocks back, + 1
    tokens = list(range(64))
    a = seq_of(tokens)
    assert bm.can_allocate(a, 64) and not bm.can_allocate(a, 65)  # 16 full + 16 sliding: all 32
    bm.allocate(a, 64)
    a.num_computed_tokens = 64
    bm.commit_computed(a)
    assert (a.window_start, len(a.window_tables[0])) == (14, 2)  # keys from 57 on: blocks 14, 15
    sliding = {}  # A's sliding blocks by position, kept and given back alike
    given_back = list(bm._free[0])
    assert len(given_back) == 14
    sliding.update(enumerate(given_back))  # given back in position order: 0..13
    sliding.update({14: a.window_tables[0][0], 15: a.window_tables[0][1]})
    bm.free(a)
    b = seq_of(tokens[:32] + [999])
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 8 and bm._window_prefix(cached) == [[sliding[6], sliding[7]]]
    bm.take_cached_prefix(b, cached)
    bm.allocate(b, 1)
    b.num_computed_tokens += 1
    bm.commit_computed(b)
    bm.free(b)
    filler = seq_of(list(range(1000, 1024)))  # 6 full + 6 sliding blocks: the 12 oldest free
    bm.allocate(filler, 24)
    again = seq_of(tokens + [999])
    found = bm.find_cached_prefix(again)
    assert len(found) == 8  # 9..16 would need sliding blocks 7..15: 8..15 were reused
    assert bm._window_prefix(found) == [[sliding[6], sliding[7]]]
    bm.take_cached_prefix(again, found)
    assert (again.window_start, again.window_tables) == (6, [[sliding[6], sliding[7]]])
    assert again.num_computed_tokens == 32


def test_random_weights_load_for_gpt_oss():
    """A gpt-oss made of random weights (the shapes of a real config, as the benchmarks
    use) loads and generates: its experts are drawn one by one, as the model holds them."""
    cfg = GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    engine = Engine(EngineConfig(model="random", random_weights=True, block_size=BS, num_kv_blocks=32), cfg)
    assert engine.kv_cache.layout.grouped
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_a_host_tier_or_self_speculation_needs_layer_groups_off(gpt_oss):
    """Neither keeps layer groups yet: with groups on (the default) each is refused with a
    sentence naming the setting; with ``kv_layer_groups`` off the cache holds every
    layer's whole sequence (as before layer groups) and the model gives transformers'
    tokens. A draft model's own cache is never grouped (its proposer drives one table)."""
    directory, hf = gpt_oss
    (prompt,) = random_prompts([40], 512, seed=6)
    expected = hf_greedy(hf, prompt, 8)
    spec = SpeculativeConfig(method="self", num_tokens=2, draft_layers=2)
    for kw in (dict(host_kv_tier_mib=8), dict(speculative=spec)):
        with pytest.raises(ValueError, match="set kv_layer_groups false"):
            engine_of(directory, **kw)
        engine = engine_of(directory, kv_layer_groups=False, **kw)
        layout = engine.kv_cache.layout
        assert not layout.grouped and layout.rows == layout.num_layers and layout.windows
        out = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert out.token_ids == expected, kw
    engine = engine_of(directory)
    assert engine.lend_prefix("loan", prompt[:32], 0) is None  # holds none of it: lends nothing


def test_a_sliding_window_draft_model_proposes_what_the_target_accepts(gpt_oss):
    """The target drafting for itself (``draft_model`` the same checkpoint): every draft
    token is the target's own greedy choice, so nearly all are accepted; a draft cache
    laid out in layer groups (which its proposer does not drive) proposed garbage."""
    directory, hf = gpt_oss
    (prompt,) = random_prompts([40], 512, seed=10)
    spec = SpeculativeConfig(method="draft", draft_model=str(directory), num_tokens=3, adaptive=False)
    engine = engine_of(directory, speculative=spec)
    assert engine.kv_cache.layout.grouped  # the target's own cache stays grouped
    out = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 24)
    stats = engine.stats().speculation
    assert stats.proposed_tokens and stats.accepted_tokens >= 0.9 * stats.proposed_tokens, stats


def test_a_pre_copy_copies_only_blocks_no_window_reaches_and_the_move_the_rest(gpt_oss):
    """Live migration with its pre-copy, engine to engine over the ``local`` backend: the
    copy ahead takes only the blocks before the window of the request's tokens so far,
    their full layers' KV alone (its ids name no sliding block); the move sends the
    rest, the sliding groups' windows with it; the request decodes on with
    transformers' tokens and holds the window and one block per group there."""
    from splitserve.kv_transfer import get_backend
    from splitserve.kv_transfer.backends.local import LocalHub

    directory, hf = gpt_oss
    (prompt,) = random_prompts([70], 512, seed=7)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    here, there = engine_of(directory), engine_of(directory)
    hub, backend = LocalHub(), get_backend("local")
    source = backend.source("here", here.kv_cache.tensor, here.kv_compat(), lease_s=30.0, hub=hub)
    sink = backend.sink("there", there.kv_cache.tensor, there.kv_compat(), hub=hub)
    sink.connect(source.handshake())
    rid = here.add_request(prompt, params)
    tokens: list[int] = []
    while len(tokens) < 4:
        for o in here.step():
            tokens.extend(o.new_token_ids)
    held, reserved = there.reserve_moving(rid, prompt, tokens, params)
    full = (len(prompt) + len(tokens) - 1) // BS  # blocks before the last token's: 18
    no_window = max(0, full * BS - WINDOW + 1) // BS  # of those, before its window: 14
    assert (held, len(reserved)) == (0, no_window)
    loan = here.lend_running(f"{rid}/pre", rid, [*prompt, *tokens][: no_window * BS], 0)
    assert (len(loan.block_ids), loan.window_from) == (no_window, no_window)  # full layers only
    desc = source.export(loan.request_id, loan.block_ids, loan.num_kv_tokens, window_from=loan.window_from)
    sink.pull(desc, reserved, timeout=30.0)
    assert there.fill_moving(rid, no_window) == no_window * BS
    here.release(loan.request_id)
    for o in here.step():  # decodes on while the copy waits
        tokens.extend(o.new_token_ids)
    moved = here.suspend(rid, from_block=no_window)
    desc = source.export(rid, moved.block_ids, moved.num_kv_tokens, window_from=moved.window_from)
    taken = there.import_request(rid, moved.prompt_token_ids, moved.output_token_ids, params)
    sink.pull(desc, taken, timeout=30.0)
    here.release(rid)
    there.activate(rid)
    seq = there.requests[rid].seq
    assert len(seq.block_table) == -(-seq.num_computed_tokens // BS)
    assert max(len(t) for t in seq.window_tables) <= WINDOW // BS + 1
    tokens = moved.output_token_ids
    while there.has_unfinished():
        for o in there.step():
            tokens.extend(o.new_token_ids)
    assert tokens == hf_greedy(hf, prompt, 16)
    assert here.block_manager.num_used_blocks == there.block_manager.num_used_blocks == 0


def test_an_fp8_pull_rescales_each_layer_s_blocks_at_its_row_with_its_own_scales():
    """A sink rescales pulled FP8 heads from the source's scales into its own
    (``kv_quant.requantize_ids``): in layer groups each layer's blocks of the transfer,
    at its row, by that layer's ratio, and nothing else; computed here layer by layer."""
    import torch

    from splitserve.engine.kv_quant import FP8, FP8_MAX, requantize_ids

    lay = KVLayout(5, 32, 16, 2, 8, "float8_e4m3fn", windows=(0, 48, 48, 0, 48), grouped=True)
    g = torch.Generator().manual_seed(0)
    cache = (torch.randn(lay.cache_shape, generator=g) * 4).to(FP8)
    src = torch.exp2(torch.randint(-3, 3, (5, 2, 2), generator=g).float())
    dst = torch.exp2(torch.randint(-3, 3, (5, 2, 2), generator=g).float())
    ids = lay.transfer_ids([3, 9, 4, 20, 7], [[21, 22, 23], [30, 1, 2]], 2)
    expected = cache.float().clone()
    for layer in range(5):
        row, blocks = lay.row(layer), lay.layer_blocks(layer, ids, 2)
        ratio = (src[layer] / dst[layer])[:, None, None, :, None]
        for b in blocks:
            expected[row, :, b] = (
                (cache[row, :, b].float() * ratio[:, 0]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
            )
    requantize_ids(cache, lay, ids, 2, slice(None), src, dst)
    assert torch.equal(cache.float(), expected)


def test_a_prefix_lent_between_engines_comes_with_its_windows_and_is_taken_whole(gpt_oss):
    """A prefix borrowed from another engine (``lend_prefix`` there, ``reserve_prefix`` and
    ``adopt_prefix`` here, the ``local`` backend between): the ids name the full blocks
    and each sliding group's window before the prefix's end; the borrower holds no
    other sliding block, the prompt then takes the whole prefix from its cache and
    gives transformers' tokens. A lender holding only part of it lends nothing."""
    from splitserve.kv_transfer import get_backend
    from splitserve.kv_transfer.backends.local import LocalHub

    directory, hf = gpt_oss
    (prompt,) = random_prompts([90], 512, seed=8)
    prefix = prompt[:80]  # 20 blocks
    lender, borrower = engine_of(directory), engine_of(directory)
    hub, backend = LocalHub(), get_backend("local")
    source = backend.source("lender", lender.kv_cache.tensor, lender.kv_compat(), lease_s=30.0, hub=hub)
    sink = backend.sink("borrower", borrower.kv_cache.tensor, borrower.kv_compat(), hub=hub)
    sink.connect(source.handshake())
    lender.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    assert lender.lend_prefix("too-long", prompt[:88] + [1] * 4, 0) is None  # its last block is not cached
    held, ids = borrower.reserve_prefix("loan", prefix)
    # each sliding group's blocks from the one holding key 80 - 16 + 1 = 65 on: 16..19
    assert held == 0 and len(ids) == 20 + 4
    seq = borrower.requests["loan"].seq
    assert (seq.window_start, [len(t) for t in seq.window_tables]) == (16, [4])
    lent = lender.lend_prefix("loan", prefix, 0)
    assert (len(lent.block_ids), lent.window_from, lent.num_kv_tokens) == (24, 16, 80)
    desc = source.export("loan", lent.block_ids, lent.num_kv_tokens, window_from=lent.window_from)
    sink.pull(desc, ids, timeout=30.0)
    lender.release("loan")
    assert borrower.adopt_prefix("loan", 20) == 80
    out = borrower.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.num_cached_tokens == 80
    assert out.token_ids == hf_greedy(hf, prompt, 8)
