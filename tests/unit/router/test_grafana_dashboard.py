"""The Grafana dashboard in the repo plots only metrics the router exposes."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from splitserve.router.registry import Membership, WorkerRegistry
from splitserve.wire.outputs import EngineStats
from splitserve.wire.prefill import PrefillStats
from tests.unit.router.test_trace_metrics import REMOTE, make_metrics, trace

DASHBOARD = Path(__file__).resolve().parents[3] / "cluster_configs" / "grafana" / "splitserve.json"


def exposed_names() -> set[str]:
    registry = WorkerRegistry()
    w = registry.add("prefill-0", "prefill", object(), 16)
    w.state, w.stats = Membership.ACTIVE, PrefillStats("prefill-0", EngineStats(1, 0, 0, 8, 4), (), 0, 0, 0)
    metrics = make_metrics(registry)
    full = trace(REMOTE, prefill="p0", kv_bytes=1, kv_pull_s=0.001)
    metrics.record(dataclasses.replace(full, token_times=(101.0, 101.6, 101.7)))
    metrics.record(trace([("admitted", 0), ("finished", 0)], "", "", False, "UNAVAILABLE", prompt_tokens=0))
    text = metrics.render().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_metric_the_dashboard_plots_is_exposed():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    used = {name for e in exprs for name in re.findall(r"splitserve:[a-z_]+", e)}
    assert len(used) >= 15
    assert used - exposed_names() == set()
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("first token", "output token", "replicas", "kv cache", "kv transfer", "errors"):
        assert topic in titles
