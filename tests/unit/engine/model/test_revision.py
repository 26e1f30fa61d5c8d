"""A checkpoint's revision (``engine.model.revision``): the same weights anywhere are
one revision, any change to them or their config another; quantization at load is
part of it; and two engines of different revisions refuse each other's KV at the
handshake, with a sentence naming both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine.engine import Engine
from splitserve.engine.model.revision import checkpoint_revision, random_revision, with_quantization
from splitserve.kv_transfer import get_backend
from splitserve.kv_transfer.backends.local import LocalHub
from splitserve.wire.config import EngineConfig
from splitserve.wire.errors import IncompatiblePeer


@pytest.fixture()
def two_revisions(checkpoint, tmp_path):
    """(the checkpoint, a copy of it, the copy with one weight changed by one ulp)."""
    copy, changed = tmp_path / "copy", tmp_path / "changed"
    shutil.copytree(checkpoint, copy)
    shutil.copytree(checkpoint, changed)
    path = changed / "model.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[-1]
    flat = tensors[name].view(-1)
    flat[len(flat) // 2] = torch.nextafter(flat[len(flat) // 2], torch.tensor(float("inf")))
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(checkpoint), copy, changed


def test_the_same_weights_anywhere_are_one_revision_and_a_change_another(two_revisions, tmp_path):
    original, copy, changed = two_revisions
    rev = checkpoint_revision(original)
    assert len(rev) == 12 and checkpoint_revision(copy) == rev  # the path and file dates do not count
    assert checkpoint_revision(changed) != rev  # one value in the middle of one tensor
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert checkpoint_revision(copy) != rev
    assert random_revision('{"a": 1}', 0) != random_revision('{"a": 1}', 1)
    assert with_quantization(rev, "none") == rev and with_quantization(rev, "int8") == f"{rev}+int8"


def _engine(model, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=16, **kw))


def test_engines_of_two_revisions_refuse_each_others_kv_naming_both(two_revisions):
    original, copy, changed = two_revisions
    hub = LocalHub()
    backend = get_backend("local")
    pre = _engine(original)
    source = backend.source("prefill-0", pre.kv_cache.tensor, pre.kv_compat(), lease_s=30.0, hub=hub)
    same = _engine(copy)
    assert same.revision == pre.revision
    backend.sink("decode-0", same.kv_cache.tensor, same.kv_compat(), hub=hub).connect(source.handshake())
    other = _engine(changed)
    sink = backend.sink("decode-1", other.kv_cache.tensor, other.kv_compat(), hub=hub)
    with pytest.raises(IncompatiblePeer) as e:
        sink.connect(source.handshake())
    message = str(e.value)
    assert f"serves revision {pre.revision}" in message and f"this one revision {other.revision}" in message
    quantized = _engine(original, quantization="int8")
    assert quantized.revision == f"{pre.revision}+int8"
    sink = backend.sink("decode-2", quantized.kv_cache.tensor, quantized.kv_compat(), hub=hub)
    with pytest.raises(IncompatiblePeer, match=r"\+int8"):
        sink.connect(source.handshake())
