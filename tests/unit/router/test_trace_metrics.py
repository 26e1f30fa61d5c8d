"""Request traces (phases that tile a request, whatever marks it has) and the
Prometheus metrics made from them, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.router.metrics import PoolSize, RouterMetrics
from splitserve.router.metrics_server import MetricsServer
from splitserve.router.registry import Membership, WorkerRegistry
from splitserve.router.trace import Mark, RequestTrace, TraceLog
from splitserve.wire.outputs import EngineStats
from splitserve.wire.prefill import PrefillStats


def trace(
    marks: list[tuple[str, float]], prefill="", decode="d0", ok=True, outcome="stop", **kw
) -> RequestTrace:
    fields = dict(prompt_tokens=10, cached_prompt_tokens=4, output_tokens=3, kv_bytes=0, kv_pull_s=0.0)
    fields |= kw
    return RequestTrace(
        request_id="r",
        outcome=outcome,
        ok=ok,
        prefill_worker=prefill,
        decode_worker=decode,
        marks=tuple(Mark(n, t) for n, t in marks),
        token_times=(),
        **fields,
    )


REMOTE = [
    ("admitted", 100.0),
    ("prefill_started", 100.5),
    ("kv_exported", 101.0),
    ("first_token", 101.1),
    ("decode_admitted", 101.4),
    ("first_decode_token", 101.6),
    ("finished", 103.0),
]


def phases(t: RequestTrace) -> list[tuple[str, float, str]]:
    return [(s.name, round(s.seconds, 6), s.worker) for s in t.spans]


def test_a_disaggregated_request_has_four_phases_that_tile_it():
    t = trace(REMOTE, prefill="p0", decode="d0")
    assert phases(t) == [
        ("queue", 0.5, ""),
        ("prefill", 0.6, "p0"),
        ("kv_transfer", 0.3, "d0"),
        ("decode", 1.6, "d0"),
    ]
    assert sum(s.seconds for s in t.spans) == pytest.approx(t.e2e_s) == pytest.approx(3.0)
    assert t.ttft_s == pytest.approx(1.1)


def test_a_locally_prefilled_request_has_no_transfer_phase():
    t = trace(
        [("admitted", 0.0), ("prefill_started", 0.2), ("first_token", 0.5), ("finished", 1.0)], decode="d1"
    )
    assert phases(t) == [("queue", 0.2, ""), ("prefill", 0.3, "d1"), ("decode", 0.5, "d1")]


def test_a_request_that_ends_at_its_first_token_ends_in_prefill():
    t = trace(
        [("admitted", 0.0), ("prefill_started", 0.2), ("first_token", 0.5), ("finished", 0.5)], "p0", ""
    )
    assert phases(t) == [("queue", 0.2, ""), ("prefill", 0.3, "p0")]


def test_a_request_refused_at_the_door_is_all_queue():
    t = trace([("admitted", 5.0), ("finished", 5.001)], decode="", ok=False, outcome="INVALID_ARGUMENT")
    assert phases(t) == [("queue", 0.001, "")]
    assert t.ttft_s is None


def test_marks_from_a_skewed_clock_are_clamped_never_negative():
    marks = [("admitted", 10.0), ("prefill_started", 9.0), ("first_token", 10.4), ("decode_admitted", 99.0)]
    t = trace([*marks, ("finished", 11.0)], prefill="p0")
    assert [s.seconds >= 0 for s in t.spans] == [True] * 4
    assert sum(s.seconds for s in t.spans) == pytest.approx(1.0)
    assert phases(t)[0] == ("queue", 0.0, "")  # began "before" it was admitted: clamped


def test_the_trace_log_keeps_the_latest():
    log = TraceLog(keep=2)
    for i in range(3):
        log.record(trace([("admitted", i), ("finished", i + 1)], outcome=str(i)))
    assert [t.outcome for t in log.latest(5)] == ["1", "2"]
    assert log.latest(0) == []


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def one(values: dict, name: str, **labels) -> float:
    hits = [
        v for (n, ls), v in values.items() if n == name and all((k, v2) in ls for k, v2 in labels.items())
    ]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def make_metrics(registry: WorkerRegistry | None = None) -> RouterMetrics:
    return RouterMetrics(
        "m",
        registry or WorkerRegistry(),
        lambda: [PoolSize("decode", 2)],
        lambda: 7,
        lambda: {("local", "gain"): 3},
        lambda: {("checksum", "recompute"): 1},
        lambda: {"d0": 6},
    )


def test_request_metrics_count_each_trace_once():
    metrics = make_metrics()
    ok = trace(REMOTE, prefill="p0", kv_bytes=4096, kv_pull_s=0.002, output_tokens=5)
    ok = dataclasses.replace(ok, token_times=(101.0, 101.6, 101.7, 101.9, 102.9))
    metrics.record(ok)
    metrics.record(
        trace([("admitted", 0), ("finished", 0)], "", "", False, "RESOURCE_EXHAUSTED", prompt_tokens=0)
    )
    v = samples(metrics.render().decode())
    assert one(v, "splitserve:time_to_first_token_seconds_count", model_name="m") == 1
    assert one(v, "splitserve:time_to_first_token_seconds_sum") == pytest.approx(1.1)
    # the refused request is not a latency
    assert one(v, "splitserve:e2e_request_latency_seconds_sum") == pytest.approx(3.0)
    assert one(v, "splitserve:request_time_per_output_token_seconds_sum") == pytest.approx(1.9 / 4)
    assert one(v, "splitserve:inter_token_latency_seconds_count") == 4
    assert one(v, "splitserve:inter_token_latency_seconds_sum") == pytest.approx(1.9)
    assert one(v, "splitserve:request_handover_time_seconds_sum") == pytest.approx(0.3)
    assert one(v, "splitserve:kv_transfer_time_seconds_sum") == pytest.approx(0.002)
    assert one(v, "splitserve:kv_transfer_bytes_total") == 4096
    assert one(v, "splitserve:kv_handoffs_total", mode="whole") == 1
    assert one(v, "splitserve:prompt_tokens_total") == 10  # the refused request had none
    assert one(v, "splitserve:decode_batch_cap", worker="d0") == 6
    assert one(v, "splitserve:generation_tokens_total") == 5 + 3
    assert one(v, "splitserve:prefix_cache_hits_total") == 4
    assert one(v, "splitserve:prefix_cache_queries_total") == 10
    assert one(v, "splitserve:request_success_total", finished_reason="stop") == 1
    assert one(v, "splitserve:request_failure_total", code="RESOURCE_EXHAUSTED") == 1
    assert one(v, "splitserve:pool_replicas", pool="decode", state="desired") == 2
    assert one(v, "splitserve:num_requests_inflight") == 7
    assert one(v, "splitserve:prefill_placement_total", placement="local", reason="gain") == 3


class _NoClient:
    pass


def test_worker_gauges_come_from_the_registrys_last_poll():
    registry = WorkerRegistry()
    w = registry.add("prefill-0", "prefill", _NoClient(), 16)
    registry.add("prefill-1", "prefill", _NoClient(), 16)  # STARTING: no figures, counted as warming
    w.stats = PrefillStats("prefill-0", EngineStats(3, 2, 100, 40, 30, num_preemptions=5), (), 0, 0, 0)
    w.state = Membership.ACTIVE
    metrics = RouterMetrics("m", registry, lambda: [PoolSize("prefill", 2, replaced=4)], lambda: 0, dict)
    v = samples(metrics.render().decode())
    assert one(v, "splitserve:num_requests_running", worker="prefill-0") == 3
    assert one(v, "splitserve:num_requests_waiting", worker="prefill-0") == 2
    assert one(v, "splitserve:kv_cache_usage_perc", worker="prefill-0") == pytest.approx(10 / 40)
    assert not [k for k in v if ("worker", "prefill-1") in k[1]]
    assert one(v, "splitserve:pool_replicas", pool="prefill", state="current") == 1
    assert one(v, "splitserve:pool_replicas", pool="prefill", state="warming") == 1
    assert one(v, "splitserve:num_preemptions_total", worker="prefill-0") == 5
    assert one(v, "splitserve:worker_replacements_total", pool="prefill") == 4


def test_a_replica_labels_its_series_and_leaves_the_workers_to_router_0():
    """Two routers over the same workers, each recording its own request: summed over
    both scrapes, requests count once each and each worker's gauges once."""
    registry = WorkerRegistry()
    w = registry.add("decode-0", "decode", _NoClient(), 16)
    w.stats = PrefillStats("decode-0", EngineStats(3, 2, 100, 40, 30), (), 0, 0, 0)
    w.state = Membership.ACTIVE
    sizes = lambda: [PoolSize("decode", 1)]  # noqa: E731
    scrapes = []
    for index, workers in ((0, True), (1, False)):
        m = RouterMetrics("m", registry, sizes, lambda: 1, dict, replica=index, workers=workers)
        m.record(trace(REMOTE, prefill="p0"))
        scrapes.append(samples(m.render().decode()))
    for index, v in enumerate(scrapes):
        assert all(("replica", str(index)) in labels for _, labels in v), "a series with no replica"
    both = {}
    for v in scrapes:
        for (name, labels), value in v.items():
            key = (name, tuple(kv for kv in labels if kv[0] != "replica"))
            both[key] = both.get(key, 0) + value
    assert one(both, "splitserve:request_success_total") == 2
    assert one(both, "splitserve:num_requests_inflight") == 2
    assert one(both, "splitserve:num_requests_running", worker="decode-0") == 3
    assert one(both, "splitserve:pool_replicas", pool="decode", state="desired") == 1


def test_the_metrics_port_serves_the_text_format():
    metrics = make_metrics()
    metrics.record(trace(REMOTE, prefill="p0"))

    async def scrape() -> tuple[str, str]:
        server = MetricsServer(metrics, "127.0.0.1", 0)
        port = await server.start()
        try:

            def get():
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                    return r.headers["Content-Type"], r.read().decode()

            return await asyncio.to_thread(get)
        finally:
            await server.stop()

    ctype, body = asyncio.run(scrape())
    assert ctype.startswith("text/plain")
    assert one(samples(body), "splitserve:request_success_total", finished_reason="stop") == 1
