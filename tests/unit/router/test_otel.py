"""Request traces exported over OTLP/gRPC by the SDK's real exporter, received by a
real gRPC collector (tests/otel_collector.py): one root span per request, a child
per phase with the request's own times and workers."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("opentelemetry.sdk")

from splitserve.router.otel import OtelSink, otlp_exporter  # noqa: E402
from tests.otel_collector import Collector  # noqa: E402
from tests.unit.router.test_trace_metrics import REMOTE, trace  # noqa: E402


def test_a_trace_becomes_a_root_span_with_one_child_per_phase():
    with Collector() as collector:
        sink = OtelSink(otlp_exporter(collector.endpoint), "svc-test", transfer_backend="nixl")
        t = trace(REMOTE, prefill="p0", decode="d0", kv_bytes=4096, kv_pull_s=0.002)
        sink.record(t)
        sink.shutdown()
        root, *children = collector.trace_of("r")
    assert root.name == "splitserve.request" and root.parent_span_id == b""
    assert root.service_name == "svc-test"
    assert (root.start_ns, root.end_ns) == (int(100.0 * 1e9), int(103.0 * 1e9))
    assert root.attributes["splitserve.prefill_worker"] == "p0"
    assert root.attributes["splitserve.decode_worker"] == "d0"
    assert root.attributes["splitserve.kv_bytes"] == 4096
    assert root.status_code != 2  # not ERROR
    assert [c.name for c in children] == [
        f"splitserve.{p}" for p in ("queue", "prefill", "kv_transfer", "decode")
    ]
    assert all(c.parent_span_id == root.span_id and c.trace_id == root.trace_id for c in children)
    assert [c.attributes["splitserve.worker"] for c in children] == ["", "p0", "d0", "d0"]
    # the phases tile the request: each begins where the one before ended
    assert children[0].start_ns == root.start_ns and children[-1].end_ns == root.end_ns
    assert all(a.end_ns == b.start_ns for a, b in zip(children, children[1:]))
    transfer = children[2].attributes
    assert transfer["splitserve.transfer_backend"] == "nixl" and transfer["splitserve.kv_pull_ms"] == 2.0


def test_a_failed_request_is_an_error_span_and_a_new_trace():
    with Collector() as collector:
        sink = OtelSink(otlp_exporter(collector.endpoint))
        sink.record(trace(REMOTE, prefill="p0", decode="d0"))
        failed = trace([("admitted", 200.0), ("finished", 200.2)], ok=False, outcome="UNAVAILABLE", decode="")
        sink.record(dataclasses.replace(failed, request_id="bad"))
        sink.shutdown()
        good = collector.trace_of("r")
        bad = collector.trace_of("bad")
    assert good[0].trace_id != bad[0].trace_id
    assert bad[0].status_code == 2  # STATUS_CODE_ERROR
    assert bad[0].attributes["splitserve.outcome"] == "UNAVAILABLE"


def test_a_process_forked_while_a_sink_lives_skips_the_sdks_resource_detection(tmp_path, monkeypatch):
    """opentelemetry-sdk 1.45+ re-detects a provider's resource in every forked child
    on a thread pool it joins there, which can hang a child of a threaded process (it
    hung Ray's process starts in the suite). A subprocess with a ``preexec_fn`` (the
    fork path, at-fork hooks run, as Ray starts its processes) must not run it."""
    import subprocess
    import sys

    import opentelemetry.sdk.trace as sdk_trace

    marker = tmp_path / "detected"

    def detect():  # runs in the child, if at all: leaves a file the parent can see
        marker.touch()
        raise SystemExit(0)

    monkeypatch.setattr(sdk_trace, "_get_process_dependent_resource", detect, raising=False)
    with Collector() as collector:
        sink = OtelSink(otlp_exporter(collector.endpoint))
        done = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: None, timeout=120)
        sink.shutdown()
    assert done.returncode == 0 and not marker.exists()
