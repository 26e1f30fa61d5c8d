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
        "handoff": "passed",
        "gpu_bench": "skipped",
        "profiles": "skipped",
        "host_time": "skipped",
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
    (handoff,) = records["handoff"]["result"]["rows"]
    assert handoff["tokens"] == 256 and handoff["mbytes"] == 256 * 128 * 1024 / 1e6  # Llama-3-8B's KV
    assert 0 < handoff["transfer_gbps"] and 0 < handoff["of_copy"]
    table = (tmp_path / "device_check.md").read_text()
    assert "| disaggregated | passed |" in table and "| deepseek_v3 | auto | cpu | True | True |" in table
    assert "| 256 | cpu | 34 |" in table


def test_the_table_reads_gpu_benchs_report():
    """The markdown of a gpu_bench stage, from the report's own JSON (``Report.to_json``)."""
    from splitserve.bench import gpu_bench as gb
    from splitserve.bench.device_check import markdown

    decode = [
        gb.DecodeRow("none", "triton", 64, 4096, 20.0, 18.0, 16 * 10**9, 32 * 10**9, 16.0, kv_dtype)
        for kv_dtype in ("bf16", "fp8")
    ]
    decode[1].graph_ms = 12.0
    prefill = [gb.PrefillRow("fp8", 8192, 150.0, 140.0, 1979.0)]
    report = gb.Report(
        "H100", "llama3-8b", 3000.0, {"bf16": 700.0}, {"bf16": 989.0}, "data sheet", decode, prefill
    )
    record = {"stage": "gpu_bench", "status": "passed", "seconds": 100.0, "result": report.to_json()}
    table = markdown([record])
    assert "| dense | none | fp8 | 64 | 4096 | 20.00 | 12.00 | 16.00 | 1.33 |" in table
    assert "| decode B=64 ctx=4096, fp8 KV / bf16 KV step | 0.67 | 0.8 | True |" in table
    assert "| fp8 | 8192 | 150.0 | 933 | 0.47 |" in table


def test_the_table_gives_the_host_times_medians():
    from splitserve.bench.device_check import markdown

    sides = {"offline": (900.0, 80.0, 8.9), "served": (1000.0, 150.0, 15.0)}
    medians = {
        f"{side}{suffix}": v[i]
        for side, v in sides.items()
        for i, suffix in enumerate(("", "_host", "_share"))
    }
    record = {"stage": "host_time", "status": "passed", "seconds": 90.0, "result": {"medians": medians}}
    table = markdown([record])
    assert "| offline | 900.0 | 80.0 | 8.9 |" in table and "| served | 1000.0 | 150.0 | 15.0 |" in table


def test_the_table_carries_the_profiles_and_a_timed_out_stages_rows(tmp_path, monkeypatch):
    """The profiles stage's kernel tables come verbatim in a code block; a stage that
    timed out keeps the rows it wrote before (``<stage>_rows.json``)."""
    import subprocess

    from splitserve.bench import device_check

    profile = "profile decode B=1 ctx=1024 triton bf16 KV: 392 kernels, 4.70 ms GPU/step"
    record = {"stage": "profiles", "status": "passed", "seconds": 30.0, "result": {"profiles": [profile]}}
    assert f"```\n{profile}\n```" in device_check.markdown([record])

    def times_out(cmd, **kw):  # the stage's child, past its bound after writing a row
        (tmp_path / "handoff_rows.json").write_text('[{"tokens": 4096}]')
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(device_check.subprocess, "run", times_out)
    stage = next(s for s in device_check.STAGES if s.name == "handoff")
    record = device_check.run_stage(stage, tmp_path, cuda=True)
    assert record["status"] == "timed out" and record["result"] == {"rows": [{"tokens": 4096}]}
