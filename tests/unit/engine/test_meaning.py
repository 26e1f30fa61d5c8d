"""A handoff checked by meaning (``engine.meaning``): a decode engine imports a prefill
engine's KV for a prompt, with one placement fault at a time (the right bytes in the
wrong place, which the transfer's checksums cannot see), and ``verify_import``
catches each one; the KV as it was passes, and the request then generates the tokens
the monolithic engine generates. Tiny random Llama (float32, and an FP8 cache) and
DeepSeek-V3 (MLA's latent rows)."""

from __future__ import annotations

import pytest
import torch

from splitserve.bench.handoff_faults import SINK_FAULTS, prefill
from splitserve.bench.tiny_models import make_hf_checkpoint
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import MeaningMismatch
from splitserve.wire.faults import HandoffFault as F
from splitserve.wire.sampling import SamplingParams
from tests.conftest import random_prompts

BLOCK = 8
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=7)


@pytest.fixture(scope="module", params=["llama", "llama-fp8", "deepseek_v3"])
def engines(request, tmp_path_factory):
    kind = request.param.split("-")[0]
    directory = tmp_path_factory.mktemp(kind)
    make_hf_checkpoint(kind, directory)
    extra = {"kv_cache_dtype": "fp8"} if request.param.endswith("fp8") else {}
    config = EngineConfig(model=str(directory), dtype="float32", block_size=BLOCK, num_kv_blocks=96, **extra)
    return request.param, Engine(config), Engine(config)


def _import(sink: Engine, rid: str, prompt, first, params, data, ids_order=None):
    ids = sink.import_request(rid, prompt, first, params)
    sink.kv_cache.write_blocks([ids[i] for i in ids_order] if ids_order else ids, data)
    return ids


def _finish(engine: Engine, rid: str) -> list[int]:
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    return tokens


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_kv_as_it_was_passes_and_the_request_runs_on(engines, params):
    name, source, sink = engines
    prompt = random_prompts([29], 512, seed=3)[0]
    want = source.generate([prompt], params)[0].token_ids
    data, first = prefill(source, "ok", prompt, params)
    ids = _import(sink, "ok", prompt, first, params, data)
    check = sink.verify_import("ok")
    assert check.ok and not check.skipped and check.position == len(prompt) - 1
    # the received bytes are put back: the request decodes on exactly what it received
    assert torch.equal(sink.kv_cache.read_blocks(ids).view(torch.uint8), data.view(torch.uint8))
    sink.activate("ok")
    assert first + _finish(sink, "ok") == want
    assert sink.block_manager.num_used_blocks == 0


# the faults each model's cache can have (``Engine.inject_fault`` refuses the others)
SHARED = {F.BLOCK_TABLE_PERMUTED, F.LAYERS_SWAPPED, F.PREFIX_BLOCK_OTHER_TOKENS}
LLAMA = SHARED | {F.KV_HEADS_SWAPPED, F.K_AND_V_SWAPPED}
APPLICABLE = {
    "llama": LLAMA,
    "llama-fp8": LLAMA | {F.FP8_SCALES_SWAPPED},
    "deepseek_v3": SHARED | {F.MLA_PARTS_SWAPPED},  # one plane, one latent "head"
}


def test_every_placement_fault_is_caught(engines):
    """Each placement fault of ``wire.faults`` (at the sink: the bytes are the source's)
    the model's cache can have, injected as a harness does (``Engine.inject_fault``)."""
    name, source, sink = engines
    prompt = random_prompts([29], 512, seed=3)[0]  # 4 blocks of 8
    data, first = prefill(source, "p", prompt, GREEDY)
    caught, refused = {}, set()
    for fault in SINK_FAULTS:
        rid = f"fault-{fault.name}"
        ids = _import(sink, rid, prompt, first, GREEDY, data)
        try:
            sink.inject_fault(rid, fault)
        except ValueError:  # refused: the KV is left as it was
            assert torch.equal(sink.kv_cache.read_blocks(ids).view(torch.uint8), data.view(torch.uint8))
            refused.add(fault)
            sink.abort(rid)
            continue
        try:
            with pytest.raises(MeaningMismatch) as info:
                sink.verify_import(rid)
            caught[fault] = info.value.check
        finally:
            sink.abort(rid)
    assert set(caught) == APPLICABLE[name] and refused == set(SINK_FAULTS) - APPLICABLE[name], caught
    assert all(not c.ok for c in caught.values()), caught
    assert sink.block_manager.num_used_blocks == 0
    # the error names the layer, the position and by how much
    kv = [c for c in caught.values() if c.check == "kv"]
    assert kv and all(c.error > c.tolerance and c.position == len(prompt) - 1 for c in kv)


def test_a_fault_never_reaches_another_request(engines):
    """A fault goes only into blocks its request holds alone, and those leave the prefix
    cache first: blocks another request holds too are refused (nothing changed), and a
    prompt prefilled again after a faulted export finds nothing cached and computes the
    clean tokens."""
    name, source, sink = engines
    prompt = random_prompts([29], 512, seed=5)[0]
    sink.generate([prompt], GREEDY)  # its full blocks stay cached here
    held = sink.hold_prefix("one", prompt, GREEDY)
    assert held >= 2 * BLOCK and sink.hold_prefix("two", prompt, GREEDY) == held  # both hold them
    before = sink.kv_cache.tensor.clone()
    with pytest.raises(ValueError, match="shared with another request"):
        sink.inject_fault("one", F.BLOCK_TABLE_PERMUTED)
    assert torch.equal(sink.kv_cache.tensor.view(torch.uint8), before.view(torch.uint8))
    sink.abort("one")
    sink.abort("two")
    other = random_prompts([29], 512, seed=6)[0]
    clean = sink.generate([other], GREEDY)[0].token_ids  # (another engine: nothing cached there)
    source.add_request(other, GREEDY, "faulted", prefill_only=True)
    while source.has_unfinished():
        source.step()
    source.inject_fault("faulted", F.SOURCE_BLOCK_REUSED)  # its blocks were cached: no more
    source.release("faulted")
    again = source.generate([other], GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == clean


def test_without_the_check_the_faulted_kv_goes_unseen(engines):
    """The mutation the issue asks for: the same faults, activated unchecked, run without
    an error (the checksums would have passed them: the bytes are the source's) and the
    block table's fault changes the tokens."""
    name, source, sink = engines
    prompt = random_prompts([29], 512, seed=3)[0]
    want = source.generate([prompt], GREEDY)[0].token_ids
    data, first = prefill(source, "p", prompt, GREEDY)
    _import(sink, "unchecked", prompt, first, GREEDY, data, [3, 1, 2, 0])
    sink.activate("unchecked")
    assert first + _finish(sink, "unchecked") != want


def test_a_sliding_window_past_the_prompts_start_is_not_checked(tmp_path):
    """Its sliding layers no longer hold every key the prompt's last position read (the
    blocks before the window are not moved): the check says so instead of failing."""
    make_hf_checkpoint("gemma2", tmp_path)  # sliding windows of 16
    config = EngineConfig(model=str(tmp_path), dtype="float32", block_size=BLOCK, num_kv_blocks=96)
    source, sink = Engine(config), Engine(config)
    prompt = random_prompts([45], 512, seed=3)[0]
    data, first = prefill(source, "w", prompt, GREEDY)
    _import(sink, "w", prompt, first, GREEDY, data)
    check = sink.verify_import("w")
    assert check.ok and "sliding" in check.skipped
    assert dict(sink.stats().meaning_checks) == {"skipped": 1}
    sink.abort("w")
