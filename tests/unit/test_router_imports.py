"""The router process loads neither torch nor any worker implementation: it
imports only plain-data records (and unpickles what workers send it)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import pickle, sys
import splitserve.router.dispatch, splitserve.router.server, splitserve.router.openai_http
import splitserve.router.registry, splitserve.router.workers, splitserve.router.service
from splitserve.decode_worker.api import TokenBatch
from splitserve.engine import FinishReason, RequestValidator, SamplingParams
from splitserve.prefill_worker import PrefillResult
validator = RequestValidator("m", vocab_size=10, max_model_len=8, max_kv_tokens=8, tokenizer=None)
batch = TokenBatch("r", [1], "", [], [], FinishReason.STOP, 0)
pickle.loads(pickle.dumps((validator, SamplingParams(), batch)))
loaded = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("torch", "transformers")
    or m in ("splitserve.prefill_worker.worker", "splitserve.decode_worker.worker")
    or m == "splitserve.engine.engine"
)
print(",".join(loaded))
"""


def test_the_router_imports_without_torch_or_worker_code():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the router loaded: {out.stdout.strip()}"
