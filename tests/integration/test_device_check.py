"""The GPU machine's prepared check (``bench.device_check``) in its CPU mode, as
the suite runs it so that it cannot rot between GPU runs: the environment stage
reports, the CUDA stages are skipped, and the disaggregated stage (a prefill
process, KV streamed over NIXL from host memory, decode here) gives every row's
tokens equal to the monolithic engine's, for the dense, MoE and MLA models, with
the model's KV dtype and FP8 KV; the table for docs/gpu.md is written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU mode (the GPU mode is the device's)"
)


def test_the_device_check_passes_in_its_cpu_mode(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.bench.device_check", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    records = {r["stage"]: r for r in json.loads((tmp_path / "device_check.json").read_text())}
    assert {n: r["status"] for n, r in records.items()} == {
        "environment": "passed",
        "gpu_tests": "skipped",
        "disaggregated": "passed",
        "gpu_bench": "skipped",
    }
    assert records["environment"]["result"]["torch"] == torch.__version__
    rows = records["disaggregated"]["result"]["rows"]
    assert {(r["model"], r["kv_cache_dtype"]) for r in rows} == {
        ("llama", "auto"),
        ("llama", "fp8"),
        ("mixtral", "auto"),
        ("mixtral", "fp8"),
        ("deepseek_v3", "auto"),
    }
    assert all(r["equal"] and r["streamed"] and r["kv_bytes"] > 0 for r in rows), rows
    table = (tmp_path / "device_check.md").read_text()
    assert "| disaggregated | passed |" in table and "| deepseek_v3 | auto | cpu | True | True |" in table
