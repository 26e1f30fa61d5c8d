"""``bench.relay_cost`` runs both paths (every token relayed through the servicer and
dispatcher, which the bench checks) and prints figures that agree with each other."""

from __future__ import annotations

import re

from splitserve.bench import relay_cost


def test_relay_cost_relays_every_token_and_prints_the_difference(capsys):
    assert relay_cost.main(["--streams", "3", "--tokens", "16", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    direct = float(re.search(r"direct \(source -> message\)\s+([\d.]+) us", out)[1])
    routed = float(re.search(r"through Generate\s+([\d.]+) us", out)[1])
    python = float(re.search(r"the router's Python per token\s+(-?[\d.]+) us", out)[1])
    assert direct > 0 and routed > 0
    assert abs(python - (routed - direct)) <= 0.11  # printed to one decimal each
