"""A worker's armed faults (``wire.faults``): each taken once, by its request, on its side;
a fault another kind of worker injects is refused at arming, naming both sides."""

from __future__ import annotations

import pytest

from splitserve.wire.errors import InvalidRequest
from splitserve.wire.faults import ArmedFault, ArmedFaults, HandoffFault


def test_a_fault_is_taken_once_by_its_request_on_its_side():
    faults = ArmedFaults("decode-0", ("pull", "sink"))
    faults.arm(ArmedFault("r1", HandoffFault.LAYERS_SWAPPED))
    assert faults.take("r2", "sink") is None  # another request
    assert faults.take("r1", "pull") is None  # another side: still armed
    assert faults.take("r1", "sink") is HandoffFault.LAYERS_SWAPPED
    assert faults.take("r1", "sink") is None  # once


def test_a_fault_of_another_side_is_refused_at_arming():
    faults = ArmedFaults("prefill-0", ("source",))
    with pytest.raises(
        InvalidRequest, match="prefill-0 injects faults at the source; LAYERS_SWAPPED strikes at the sink"
    ):
        faults.arm(ArmedFault("r1", HandoffFault.LAYERS_SWAPPED))
    assert faults.take("r1", "sink") is None


def test_a_fault_that_cannot_apply_is_logged_and_the_request_goes_on(caplog):
    with ArmedFaults("decode-0", ("sink",)).injecting("r1", HandoffFault.KV_HEADS_SWAPPED):
        raise ValueError("this fault needs two KV heads")  # stays inside: the test goes on
    assert "fault KV_HEADS_SWAPPED not injected into request r1: this fault needs two KV heads" in caplog.text
