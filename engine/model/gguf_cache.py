"""GGUF files are read once through transformers and kept as a Hugging Face
checkpoint directory, because transformers' GGUF reader takes ~20 s for
SmolLM2-135M on a 2-core machine and every worker would pay it at start-up.

The converted directory (``config.json``, tokenizer files, float32 safetensors:
exactly the tensors transformers dequantized) lives under
``$SPLITSERVE_CACHE_DIR`` (default ``~/.cache/splitserve``), keyed by the GGUF
file's name, size and modification time, so a changed file converts again.
Writes go to a temporary directory renamed into place, so concurrent workers
never see half a checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE_DIR", Path.home() / ".cache" / "splitserve"))


def converted_checkpoint(gguf_path: Path) -> Path:
    """Directory holding ``gguf_path`` as an HF checkpoint, converting it on first use."""
    st = gguf_path.stat()
    target = cache_root() / f"{gguf_path.stem}-{st.st_size}-{int(st.st_mtime)}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a checkpoint in %s (once; later starts reuse it)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        kw = {"gguf_file": gguf_path.name}
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the saved weights are dequantized
        config.save_pretrained(str(tmp))
        tensors = {
            k: v.contiguous()
            for k, v in model.state_dict().items()
            if not (config.tie_word_embeddings and k == "lm_head.weight")
        }
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw).save_pretrained(str(tmp))
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
