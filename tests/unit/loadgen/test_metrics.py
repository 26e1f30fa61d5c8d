"""The serving metrics against hand-computed examples (vLLM's definitions)."""

import pytest

from splitserve.loadgen.metrics import RequestRecord, compute_metrics, meets_slos


def rec(chunks, tokens=None, prompt_len=10, success=True, rejected=False):
    tokens = tokens or [1] * len(chunks)
    return RequestRecord(prompt_len, 0.0, list(chunks), list(tokens), success, rejected)


def test_per_request_definitions():
    r = rec([0.5, 0.6, 0.8, 1.1])  # 4 tokens, one per chunk
    assert r.ttft == 0.5 and r.latency == 1.1
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    coalesced = rec([0.5, 0.9], tokens=[1, 3])  # 4 tokens in 2 chunks: one ITL gap, same TPOT rule
    assert coalesced.output_len == 4 and coalesced.tpot == pytest.approx(0.4 / 3)
    assert coalesced.itls == pytest.approx([0.4])
    assert rec([0.3]).tpot is None  # one output token: no TPOT sample


def test_run_summary_and_vllm_keys():
    records = [rec([0.1, 0.2, 0.3]), rec([0.3, 0.5]), rec([0.2])]
    m = compute_metrics(records, duration_s=2.0, percentiles=(50, 99))
    assert m["completed"] == 3 and m["failed"] == 0
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 3.0
    assert m["total_token_throughput"] == 18.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT samples: 100 ms and 200 ms (the one-token request has none).
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["p99_tpot_ms"] == pytest.approx(100 + 0.99 * 100)  # numpy's linear percentile
    # ITL pooled over requests: 100, 100, 200 ms.
    assert m["mean_itl_ms"] == pytest.approx(400 / 3)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx((300 + 500 + 200) / 3)
    assert m["std_e2el_ms"] == pytest.approx(124.7219, rel=1e-4)
    assert "handovers" not in m and "median_handover_ms" not in m  # none of them had one


def test_handover_summarises_only_the_requests_that_had_one():
    records = [rec([0.1, 0.2]), rec([0.3, 0.5]), rec([0.2, 0.4]), rec([0.4], success=False)]
    records[0].handover, records[1].handover = 0.002, 0.010
    records[3].handover = 5.0  # failed: not a sample
    m = compute_metrics(records, duration_s=1.0, percentiles=(50,))
    assert m["handovers"] == 2
    assert m["median_handover_ms"] == pytest.approx(6.0) and m["mean_handover_ms"] == pytest.approx(6.0)


def test_goodput_and_attainment_count_failures_and_rejections_as_misses():
    records = [
        rec([0.1, 0.2, 0.3]),  # ttft 100, tpot 100: good
        rec([0.6, 0.7]),  # ttft 600: misses a 500 ms TTFT SLO
        rec([0.1, 0.5]),  # tpot 400: misses a 150 ms TPOT SLO
        rec([0.2]),  # one token: TPOT counts as 0, good
        rec([], success=False),  # failed
        rec([], success=False, rejected=True),  # rejected by admission control
    ]
    slos = {"ttft": 500, "tpot": 150}
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False, False]
    m = compute_metrics(records, duration_s=4.0, slos_ms=slos)
    assert m["request_goodput"] == 0.5  # 2 good requests / 4 s
    assert m["slo_attainment"] == pytest.approx(2 / 6)
    assert (m["completed"], m["failed"], m["rejected"]) == (4, 1, 1)


def test_no_successful_requests_and_bad_arguments():
    m = compute_metrics([rec([], success=False)], duration_s=1.0, slos_ms={"e2el": 1000})
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["slo_attainment"] == 0.0
    with pytest.raises(ValueError, match="unknown SLO"):
        compute_metrics([], 1.0, slos_ms={"latency": 5})
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], 0.0)
