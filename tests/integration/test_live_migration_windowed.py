"""Live migration of a model with sliding-window layers and attention sinks (a tiny
gpt-oss): two real decode workers, NIXL between them. A request moved mid-stream,
its prompt longer than the window, streams on with the tokens transformers'
``generate`` gives, and the move pulled its KV (no recompute: recompute would hide
a broken move), part of it copied ahead while the request still decoded (the
pre-copy takes the blocks no window reaches again, their full layers' KV: layer
groups, ``KVLayout.grouped``)."""

from __future__ import annotations

import pytest

from splitserve.bench.migration_pause import MOVE_AFTER, DecodePair, stream
from splitserve.wire.config import EngineConfig
from splitserve.wire.sampling import SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint, random_prompts
from tests.integration.cluster_util import assert_move_pulled, trace_of

TOKENS = 96


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt-oss")
    return directory, make_hf_checkpoint("gpt_oss", directory)


def test_a_gpt_oss_request_moved_mid_stream_keeps_transformers_tokens(model):
    directory, hf = model
    prompt = random_prompts([50], 512, seed=21)[0]  # past the 16-token window
    # enough tokens that the request still decodes when the move (after its pre-copy)
    # reaches the old worker: with 24 it once ended first, and the move found nothing to move
    expected = hf_greedy(hf, prompt, TOKENS)
    engine = EngineConfig(model=str(directory), dtype="float32", kv_cache_memory_mib=16, block_size=8)
    pair = DecodePair(engine)
    try:
        d = pair.dispatcher
        failures = dict(d.transfer_failures)
        before = {wid: pair.run(c.stats()).engine for wid, c in pair.clients.items()}
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        run = pair.run(stream(d, "moved", prompt, params, by="kv"))
        assert run.moved_at is not None and len(run.tokens) > MOVE_AFTER
        assert run.tokens == expected  # nothing repeated, skipped or changed by the move
        assert_move_pulled(trace_of(d.traces.latest(1), "moved"), to=run.worker)  # with its KV
        assert dict(d.transfer_failures) == failures
        after = {wid: pair.run(c.stats()).engine for wid, c in pair.clients.items()}
        precopied = sum(after[w].import_precopied_tokens - before[w].import_precopied_tokens for w in after)
        assert precopied > 0  # copied ahead of the move
    finally:
        pair.close()
