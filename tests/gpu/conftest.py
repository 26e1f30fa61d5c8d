"""Each GPU test starts with the device's memory free of the last one's engines.

An engine left for the garbage collector still holds its KV cache (by default
sized to most of the free memory), so the next engine's sizing would see almost
nothing free, or the next allocation would run out (seen on an H200).
"""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _free_cuda_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
