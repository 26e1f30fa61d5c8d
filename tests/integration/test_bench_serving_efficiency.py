"""``bench.serving_efficiency`` end to end on the tiny model: it serves every
request through a real cluster (the bench itself checks every output token
arrived), runs the same requests offline, and prints the ratio; then a Poisson stream at
half that rate, whose TPOT it sets against the engine's own decode step and against
the same trace replayed into the engine in-process."""

from __future__ import annotations

import re

import pytest

from splitserve.bench import serving_efficiency
from tests.conftest import tiny_checkpoint
from tests.integration.cluster_util import own_ray


def test_serving_efficiency_runs_both_paths(tmp_path_factory, capsys):
    own_ray()  # the bench starts a Ray of its own
    checkpoint = tiny_checkpoint(tmp_path_factory)
    args = ["--model", checkpoint, "--requests", "4", "--input-len", "20", "--output-len", "8", "--cpus", "1"]
    assert serving_efficiency.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"\b1 of \d+ CPUs for the engine", out), out
    rates = {m[0]: float(m[1]) for m in re.findall(r"^(offline|served)\s+([\d.]+)$", out, re.M)}
    offline, served = rates["offline"], rates["served"]
    assert offline > 0 and served > 0
    ratio = float(re.search(r"served / offline = ([\d.]+)x", out)[1])
    assert ratio == pytest.approx(served / offline, rel=0.01, abs=0.002)  # the rates are printed rounded
    half = re.search(
        r"TPOT p50 ([\d.]+) ms; .* decode step at batch (\d+): ([\d.]+) ms; TPOT / step = ([\d.]+)x", out
    )
    assert half is not None, out
    # the client's TPOT may be 0.0: a client behind the stream gets a request's tokens
    # coalesced into one message (seen on a loaded machine), all at one arrival time
    assert float(half[1]) >= 0 and int(half[2]) >= 1 and float(half[3]) > 0 and float(half[4]) >= 0
    replay = re.search(r"TPOT p50 ([\d.]+) ms; served / replayed = ([\d.]+)x", out)
    assert replay is not None, out
    assert float(replay[1]) > 0 and float(replay[2]) >= 0
