"""DeepSeek-V3.2's sparse attention: the indexer's key of every token is kept in its
cache row beside the MLA latent, so a V3.2 cache is wider than a V3 one of the same
shapes and the two refuse each other's KV at the handoff's handshake (a peer
without the indexer's keys would attend with none). Greedy equality with
transformers is ``test_moe_correctness``'s; the handoff through a cluster
``tests/integration/test_cluster_moe.py``'s."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.engine.engine import Engine
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.backends.local import LocalHub
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import IncompatiblePeer
from tests.conftest import make_hf_checkpoint


def test_a_v32_cache_row_holds_the_indexers_key_and_a_v3_peer_is_refused(tmp_path):
    v32, v3 = (
        make_hf_checkpoint("deepseek_v32", tmp_path / "v32"),
        make_hf_checkpoint("deepseek_v3", tmp_path / "v3"),
    )
    engines = {
        name: Engine(EngineConfig(model=str(tmp_path / name), dtype="float32", num_kv_blocks=16))
        for name in ("v32", "v3")
    }
    row = {name: e.kv_cache.layout.head_dim for name, e in engines.items()}
    c = v32.config
    assert row["v32"] == c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim
    assert row["v3"] == v3.config.kv_lora_rank + v3.config.qk_rope_head_dim
    hub, backend = LocalHub(), get_backend("local")
    v32_compat = engines["v32"].kv_compat()
    source = backend.source("prefill-0", engines["v32"].kv_cache.tensor, v32_compat, lease_s=30, hub=hub)
    # even a V3 cache claiming the V3.2 weights' revision: its rows lack the indexer's keys
    claimed = dataclasses.replace(engines["v3"].kv_compat(), revision=v32_compat.revision)
    sink = backend.sink("decode-0", engines["v3"].kv_cache.tensor, claimed, hub=hub)
    with pytest.raises(IncompatiblePeer, match="layout|head_dim"):
        sink.connect(source.handshake())
    # and a V3.2 peer connects
    backend.sink("decode-1", engines["v32"].kv_cache.tensor, v32_compat, hub=hub).connect(source.handshake())
