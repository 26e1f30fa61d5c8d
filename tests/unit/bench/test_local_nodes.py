"""``bench.local_nodes.add_node``: a Ray node that did not register in Ray's fixed 30 s is
ended and started again; any other failure is not retried. Ray's ``Cluster`` is a
stand-in here (the harness that uses it runs in tests/integration/test_chaos.py)."""

from __future__ import annotations

import pytest
from ray._private.node import Node

from splitserve.bench.local_nodes import _START_TRIES, add_node

TIMED_OUT = "The current node timed out during startup. This could happen because ..."


class _HalfStartedNode(Node):
    """A node whose start fails as Ray's does: raised from its own ``__init__``."""

    ended: list[_HalfStartedNode] = []

    def __init__(self, message: str):
        raise Exception(message)

    def kill_all_processes(self, check_alive=True, allow_graceful=False, wait=False):
        _HalfStartedNode.ended.append(self)


class _Cluster:
    """Fails ``failures`` starts with ``message``, then returns the node's arguments."""

    def __init__(self, failures: int, message: str = TIMED_OUT):
        self.failures, self.message, self.calls = failures, message, []

    def add_node(self, **node_args):
        self.calls.append(node_args)
        node_args["_system_config"]["added_by_ray"] = True  # Ray adds to what it is given
        if len(self.calls) <= self.failures:
            _HalfStartedNode(self.message)
        return node_args


@pytest.fixture(autouse=True)
def _no_ended_nodes():
    _HalfStartedNode.ended.clear()


def test_a_node_that_missed_registration_is_ended_and_started_again():
    cluster, args = _Cluster(failures=_START_TRIES - 1), {"num_cpus": 2, "_system_config": {"a": 1}}
    started = add_node(cluster, args)
    assert len(cluster.calls) == _START_TRIES
    assert len(_HalfStartedNode.ended) == _START_TRIES - 1  # each half-started node ended
    assert started["num_cpus"] == 2
    assert args == {"num_cpus": 2, "_system_config": {"a": 1}}  # each try had its own copy


def test_gives_up_after_the_last_try():
    cluster = _Cluster(failures=_START_TRIES)
    with pytest.raises(Exception, match="timed out during startup"):
        add_node(cluster, {"_system_config": {}})
    assert len(cluster.calls) == _START_TRIES


def test_any_other_failure_is_raised_at_once():
    cluster = _Cluster(failures=1, message="port 6379 is taken")
    with pytest.raises(Exception, match="port 6379"):
        add_node(cluster, {"_system_config": {}})
    assert len(cluster.calls) == 1 and _HalfStartedNode.ended == []
