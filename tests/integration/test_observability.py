"""What an operator sees: the router's Prometheus ``/metrics`` under real load
through the SDK (parsed with prometheus_client's parser and checked against
what the clients received), and each request's trace (its phases and workers,
in the ``Final`` message and in ``splitserve status --traces``). Real Ray
actors, the real gRPC router, KV over NIXL, the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import io
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from splitserve.cli.main import main as cli_main
from splitserve.client import AsyncClient, Client, Completion, InvalidArgument
from tests.conftest import random_prompts
from tests.integration.cluster_util import VOCAB, live_cluster, mixed_workload, scrape, tiny_config, total
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def collector():
    """An OTLP collector the cluster exports its traces to (None without the otel extra)."""
    try:
        from tests.otel_collector import Collector
    except ImportError:
        yield None
        return
    with Collector() as c:
        yield c


@pytest.fixture(scope="module")
def cluster(checkpoint, collector):
    router = {"port": 0, "http_port": 0, "shutdown_grace_s": 1}
    if collector is not None:
        router["otel_endpoint"] = collector.endpoint
    with live_cluster(tiny_config(checkpoint, router=router)) as c:
        yield c


def timed_stream(address: str, prompt: list[int], max_tokens: int, stop) -> tuple[Completion, float, float]:
    """One streamed request; returns it with the client's own TTFT and end-to-end time
    (the channel is connected before the clock starts)."""
    out = Completion()
    with Client(address, timeout=300) as client:
        client.list_models()
        start = time.perf_counter()
        first = None
        for item in client.stream(prompt, temperature=0, max_tokens=max_tokens, stop_token_ids=list(stop)):
            if first is None:
                first = time.perf_counter() - start
            out.add(item)
        return out, first, time.perf_counter() - start


def stream_paced(address: str, requests, rate: float) -> list[tuple[Completion, float, float]]:
    """Open-loop load on one asyncio loop: request i is sent at i / ``rate`` s (arrivals
    as a load generator makes them; many overlap), each timed from its send to its
    first and last items."""

    async def one(client: AsyncClient, at: float, prompt, max_tokens, stop):
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        out, first = Completion(), None
        start = time.perf_counter()
        async for item in client.stream(
            prompt, temperature=0, max_tokens=max_tokens, stop_token_ids=list(stop)
        ):
            if first is None:
                first = time.perf_counter() - start
            out.add(item)
        return out, first, time.perf_counter() - start

    async def run():
        async with AsyncClient(address, timeout=300) as client:
            await client.list_models()  # connected before any clock starts
            t0 = time.perf_counter()
            return await asyncio.gather(*(one(client, t0 + i / rate, *r) for i, r in enumerate(requests)))

    return asyncio.run(run())


def test_metrics_agree_with_what_the_clients_saw(cluster, client):
    _, params = mixed_workload(24, seed=5)
    # long prompts (chunked: several prefill steps each), so that the TTFT the clients
    # measure is mostly the cluster's, not the network's
    prompts = random_prompts([400 + (i * 211) % 500 for i in range(len(params))], VOCAB, seed=5)
    requests = [(p, sp.max_tokens, tuple(sp.stop_token_ids)) for p, sp in zip(prompts, params)]
    before = scrape(cluster)
    # The clients run in a process of their own, as they would in use (in this one they
    # would share the GIL with the router and see latencies the router cannot).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        load = clients.submit(stream_paced, cluster.address, requests, 50.0)
        during = scrape(cluster)
        results = load.result()
    after = scrape(cluster)

    def delta(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    n = len(results)
    assert all(c.final is not None for c, _, _ in results)
    assert delta("splitserve:time_to_first_token_seconds_count") == n
    assert delta("splitserve:e2e_request_latency_seconds_count") == n
    assert sum(delta("splitserve:request_success_total", finished_reason=r) for r in ("stop", "length")) == n
    # The histogram holds the TTFT each client was told in its Final (float32 there), and
    # each of those lies inside the window the client itself measured. (How close the two
    # windows are depends on how busy the machine is, so that is a benchmark's figure.)
    router_ttft = delta("splitserve:time_to_first_token_seconds_sum")
    told = sum(c.final.ttft_ms for c, _, _ in results) / 1000
    print(f"TTFT sum: router {router_ttft:.3f} s, clients {sum(f for _, f, _ in results):.3f} s")
    assert router_ttft == pytest.approx(told, rel=1e-5, abs=1e-4)
    assert all(c.final.ttft_ms <= first * 1000 + 0.01 for c, first, _ in results)
    assert delta("splitserve:generation_tokens_total") == sum(len(c.token_ids) for c, _, _ in results)
    assert delta("splitserve:prompt_tokens_total") == sum(c.final.prompt_tokens for c, _, _ in results)
    assert delta("splitserve:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("splitserve:prefix_cache_hits_total") == sum(
        c.final.cached_prompt_tokens for c, _, _ in results
    )
    assert delta("splitserve:kv_transfer_bytes_total") > 0  # every prompt went to a prefill worker
    pulls = delta("splitserve:kv_transfer_time_seconds_count")
    assert pulls == sum(c.final.kv_pull_ms > 0 for c, _, _ in results)
    # over nixl, handoffs stream (the decode worker pulls while prefill computes); one
    # whose last prefill step was over before the worker announced it goes whole
    streamed = delta("splitserve:kv_handoffs_total", mode="streamed")
    assert streamed + delta("splitserve:kv_handoffs_total", mode="whole") == pulls
    assert streamed > 0
    # per-token figures: every gap between two tokens of a request, once
    assert delta("splitserve:inter_token_latency_seconds_count") == sum(
        len(c.token_ids) - 1 for c, _, _ in results
    )
    # gauges: one series per worker, from the registry's polling
    assert {dict(ls)["worker"] for (n, ls) in during if n == "splitserve:kv_cache_usage_perc"} == {
        "prefill-0",
        "decode-0",
    }
    assert total(after, "splitserve:pool_replicas", pool="decode", state="current") == 1
    assert total(after, "splitserve:pool_replicas", pool="prefill", state="desired") == 1

    # the KV gauge returns to zero once the next polls see the load gone
    wait_until(lambda: total(scrape(cluster), "splitserve:kv_cache_usage_perc") == 0, "the KV gauge at 0")
    assert total(scrape(cluster), "splitserve:num_requests_inflight") == 0


def test_failures_are_counted_by_code(cluster, client):
    before = scrape(cluster)
    with pytest.raises(InvalidArgument):
        client.generate([1, VOCAB + 5], temperature=0, max_tokens=2)
    after = scrape(cluster)
    code = "INVALID_ARGUMENT"
    assert (
        total(after, "splitserve:request_failure_total", code=code)
        - total(before, "splitserve:request_failure_total", code=code)
        == 1
    )
    # refused at the door: no prompt tokens counted, no latency observed
    assert total(after, "splitserve:prompt_tokens_total") == total(before, "splitserve:prompt_tokens_total")


def test_a_trace_names_both_workers_and_its_phases_add_up(cluster, client):
    prompt = mixed_workload(1, seed=9)[0][0] * 3
    final, _, client_e2e = timed_stream(cluster.address, prompt, 24, ())
    f = final.final
    phases = f.queue_ms + f.prefill_ms + f.transfer_ms + f.decode_ms
    assert (f.prefill_worker, f.decode_worker) == ("prefill-0", "decode-0")
    assert phases == pytest.approx(f.e2e_ms, abs=0.01)
    assert f.e2e_ms <= client_e2e * 1000  # the router's window lies inside the client's
    # The decode worker passes the first token on before it pulls (and over nixl the pull
    # overlaps the prefill), so the handover the client sees (the router passed the first
    # token -> the decode worker holds the KV) may be none: the router can pass the first
    # token after the KV has landed. The pull itself always took time.
    assert f.prefill_ms > 0 and f.transfer_ms >= 0 and f.kv_pull_ms > 0 and f.decode_ms > 0
    assert f.ttft_ms == pytest.approx(f.queue_ms + f.prefill_ms, abs=0.01)

    st = client.cluster_status(traces=5)
    (t,) = [
        t for t in st.traces if t.output_tokens == len(final.token_ids) and t.prompt_tokens == len(prompt)
    ]
    assert t.outcome == f.finish_reason
    assert [s.name for s in t.spans] == ["queue", "prefill", "kv_transfer", "decode"]
    assert [s.worker for s in t.spans] == ["", "prefill-0", "decode-0", "decode-0"]
    assert sum(s.duration_ms for s in t.spans) == pytest.approx(f.e2e_ms, abs=0.01)
    names = [m.name for m in t.marks]
    for name in ("admitted", "prefill_started", "kv_exported", "first_token", "decode_admitted", "finished"):
        assert name in names
    assert t.spans[2].duration_ms == pytest.approx(f.transfer_ms, abs=0.01) and t.kv_pull_ms > 0

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["status", "--server", cluster.address, "--traces", "1"]) == 0
    shown = out.getvalue()
    assert st.traces[-1].request_id == t.request_id and t.request_id in shown
    for word in ("kv_transfer", "prefill-0", "decode-0"):
        assert word in shown


def test_the_trace_reaches_an_opentelemetry_collector(cluster, client, collector):
    if collector is None:
        pytest.skip("the otel extra is not installed")
    final = Completion()
    for item in client.stream(
        mixed_workload(1, seed=11)[0][0], temperature=0, max_tokens=12, request_id="otel-1"
    ):
        final.add(item)
    root, *phases = collector.trace_of("otel-1")
    assert root.attributes["splitserve.prefill_worker"] == "prefill-0"
    assert root.attributes["splitserve.decode_worker"] == "decode-0"
    assert [p.name for p in phases] == [
        f"splitserve.{n}" for n in ("queue", "prefill", "kv_transfer", "decode")
    ]
    assert root.attributes["splitserve.output_tokens"] == len(final.token_ids)
    e2e_ms = (root.end_ns - root.start_ns) / 1e6
    assert sum(p.end_ns - p.start_ns for p in phases) / 1e6 == pytest.approx(e2e_ms, abs=0.01)
    assert e2e_ms == pytest.approx(final.final.e2e_ms, abs=0.01)
