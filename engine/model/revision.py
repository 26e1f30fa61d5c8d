"""Which weights an engine serves, as a short name: its revision.

KV computed by one revision of a model means nothing to an engine holding
another (a fine-tune, a re-quantization, a new upload of the same name), though
every shape agrees. So the KV compatibility hash (``wire.kv.CompatInfo``)
includes the revision, a handshake between revisions is refused, and the
router pairs workers of one revision only; a rolling upgrade can then run
under load.

A checkpoint's revision is a fingerprint of its files, not of its path or
dates (the same weights copied to another node are the same revision; a
GGUF converted on two nodes gives the same checkpoint)::

    sha256 over  config.json's bytes
                 and, per safetensors file in name order: its name, its size, its
                 header (every tensor's name, dtype, shape and offsets) and
                 SAMPLES chunks of SAMPLE_BYTES at evenly spaced offsets

About a megabyte read per file instead of all of it: another revision of the
same shapes (any retraining or requantization) differs in every sampled
chunk. Random weights (``random_weights``, or a config without a checkpoint)
are named by their config and seed. The quantization applied at load time
changes the weights too: it is appended (``<fingerprint>+fp8``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from splitserve.engine.model.checkpoint import checkpoint_files

SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
LENGTH = 12  # hex digits kept: 48 bits, for people to read and compare


def checkpoint_revision(directory: Path) -> str:
    """The fingerprint of the checkpoint in ``directory`` (see the module docstring)."""
    h = hashlib.sha256((directory / "config.json").read_bytes())
    for path in checkpoint_files(directory):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(header_len))
            for i in range(SAMPLES):
                f.seek(size * i // SAMPLES)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:LENGTH]


def random_revision(hf_config_json: str, seed: int) -> str:
    """The name of a random-weight model: its config and seed."""
    blob = json.dumps({"config": json.loads(hf_config_json), "seed": seed}, sort_keys=True)
    return "random-" + hashlib.sha256(blob.encode()).hexdigest()[:LENGTH]


def with_quantization(revision: str, quantization: str) -> str:
    """``revision`` as weights quantized at load (``none``: as they are)."""
    return revision if quantization == "none" else f"{revision}+{quantization}"
