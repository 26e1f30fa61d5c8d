"""Workloads and arrivals of the serving benchmark."""

import json

import numpy as np
import pytest

from splitserve.loadgen import workloads
from splitserve.loadgen.serve import parse_goodput


def test_gamma_arrivals_have_the_asked_rate_and_burstiness():
    rate = 4.0
    for burstiness in (1.0, 0.25):
        t = np.array(workloads.arrival_times(20000, rate, burstiness, seed=1))
        gaps = np.diff(t)
        assert t[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
        # Gamma(k, theta): coefficient of variation 1/sqrt(k); burstier means more variable gaps.
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)
    assert workloads.arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    assert workloads.arrival_times(5, 2.0, seed=7) == workloads.arrival_times(5, 2.0, seed=7)
    with pytest.raises(ValueError):
        workloads.arrival_times(5, 0.0)


def test_datasets_lengths_and_token_range():
    reqs = workloads.random_requests(50, 100, 20, vocab_size=1000, seed=0, range_ratio=0.5)
    assert all(50 <= len(r.prompt_ids) <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(100 <= t < 1000 for r in reqs for t in r.prompt_ids)
    fixed = workloads.random_requests(5, 64, 8, vocab_size=1000)
    assert {len(r.prompt_ids) for r in fixed} == {64} and {r.output_len for r in fixed} == {8}
    shared = workloads.shared_prefix(4, 32, 8, 5, vocab_size=1000)
    assert all(r.prompt_ids[:32] == shared[0].prompt_ids[:32] and len(r.prompt_ids) == 40 for r in shared)
    groups = workloads.shared_prefix(60, 32, 8, 5, vocab_size=1000, num_prefixes=4)
    heads = {tuple(r.prompt_ids[:32]) for r in groups}
    assert len(heads) == 4  # four system prompts, each shared by many requests
    assert len({tuple(r.prompt_ids[32:]) for r in groups}) == 60  # suffixes are the requests' own
    mixed = workloads.mixed(40, vocab_size=1000, long_fraction=0.1, long_len=2048, short_len=128)
    assert sum(len(r.prompt_ids) == 2048 for r in mixed) == 4
    assert all(64 <= len(r.prompt_ids) <= 192 for r in mixed if len(r.prompt_ids) != 2048)
    sg = workloads.sharegpt_like(500, vocab_size=1000, max_input=1024)
    lens = np.array([len(r.prompt_ids) for r in sg])
    assert lens.max() <= 1024 and 60 < np.median(lens) < 160  # long-tailed around ~100


def test_trace_replay(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 12.5, "input_len": 3, "output_len": 4},
        {"timestamp": 10.0, "input_len": 5, "output_len": 1},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    reqs = workloads.trace(path, vocab_size=1000)
    assert [(r.arrival_s, len(r.prompt_ids), r.output_len) for r in reqs] == [(0.0, 5, 1), (2.5, 3, 4)]
    path.write_text(json.dumps({"timestamp": 1}))
    with pytest.raises(ValueError, match="input_len"):
        workloads.trace(path, vocab_size=1000)


def test_goodput_flag():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="tpot:MS"):
        parse_goodput(["itl:5"])


def test_multi_turn_conversations_resend_their_history():
    convs = workloads.multi_turn(30, 3, 40, 10, 6, vocab_size=1000, seed=2, num_prefixes=2, think_s=0.5)
    assert len({tuple(c.system_ids) for c in convs}) == 2 and all(len(c.system_ids) == 40 for c in convs)
    assert all(c.turns == 3 and all(5 <= len(u) <= 15 for u in c.user_ids) for c in convs)
    pauses = np.array([t for c in convs for t in c.think_s])
    assert pauses.min() >= 0 and 0.3 < pauses.mean() < 0.7
    c = convs[0]
    answers = [[1, 2], [3]]
    assert c.prompt(0, []) == c.system_ids + c.user_ids[0]
    assert c.prompt(2, answers) == c.system_ids + c.user_ids[0] + [1, 2] + c.user_ids[1] + [3] + c.user_ids[2]
    assert workloads.multi_turn(2, 2, 8, 4, 1, 1000, think_s=0)[0].think_s == [0.0, 0.0]


def test_shifting_goes_decode_heavy_prefill_heavy_and_back():
    reqs = workloads.shifting(30, 1000, seed=3, short_len=64, long_len=1024, output_len=256)
    phases = [reqs[:10], reqs[10:20], reqs[20:]]
    for phase in (phases[0], phases[2]):
        assert all(32 <= len(r.prompt_ids) <= 96 and r.output_len == 256 for r in phase)
    assert all(len(r.prompt_ids) == 1024 and r.output_len == 32 for r in phases[1])
    assert all(100 <= t < 1000 for r in reqs for t in r.prompt_ids)


def test_the_timeline_bins_demand_by_send_time_and_keeps_only_role_changes():
    from splitserve.loadgen.metrics import RequestRecord
    from splitserve.loadgen.timeline import timeline

    def rec(sent: float, prompt: int, output: int) -> RequestRecord:
        return RequestRecord(prompt, sent, [sent + 1.0], [output], success=True)

    records = [rec(100.0, 500, 20), rec(103.0, 100, 30), rec(111.0, 1000, 5)]
    roles = [(99.0, 0, 2), (101.0, 0, 2), (104.5, 1, 1), (112.0, 1, 1), (113.0, 0, 2)]
    t = timeline(records, roles, bin_s=5.0)
    assert t["demand"] == [[0.0, 120.0, 10.0], [5.0, 0.0, 0.0], [10.0, 200.0, 1.0]]
    assert t["roles"] == [[-1.0, 0, 2], [4.5, 1, 1], [13.0, 0, 2]]
    assert t["role_changes"] == 2
    assert t["sent"] == [[0.0, 500, 20], [3.0, 100, 30], [11.0, 1000, 5]]
