"""``dtype: auto`` on a CPU: bfloat16 only where the CPU computes bf16 natively (its flags
name AVX512-BF16 or AMX-BF16); plain AVX-512, where oneDNN converts bf16 and runs it
about 4x slower than float32, keeps float32."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import device
from splitserve.wire.config import EngineConfig


@pytest.mark.parametrize(
    "flags, want",
    [
        ({"avx512f", "avx512_vnni"}, torch.float32),
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
        ({"avx2"}, torch.float32),
    ],
)
def test_auto_is_bf16_only_where_the_cpu_has_it_natively(monkeypatch, flags, want):
    monkeypatch.setattr(device, "_cpu_flags", lambda: flags)
    assert device.resolve_dtype(EngineConfig(dtype="auto"), torch.device("cpu")) is want
    assert device.resolve_dtype(EngineConfig(dtype="float32"), torch.device("cpu")) is torch.float32


def test_where_no_flags_can_be_read_onednn_decides(monkeypatch):
    monkeypatch.setattr(device, "_cpu_flags", lambda: None)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert device.cpu_has_native_bf16()


def test_this_machines_flags_are_read():
    flags = device._cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags here")
    assert flags and all(isinstance(f, str) and f for f in flags)
