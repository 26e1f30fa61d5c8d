"""Timing on a CUDA device, shared by the GPU studies (``gpu_bench``,
``decode_attention``); torch only, as the GPU image has no Ray."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
