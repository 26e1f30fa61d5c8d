"""Fixtures shared by the cluster test modules. Each module defines its own
``cluster`` (module scope: one Ray instance and one cluster per module); the
fixtures here build on it."""

from __future__ import annotations

import pytest

from splitserve.client import Client
from splitserve.engine.engine import Engine
from splitserve.wire.config import EngineConfig


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The monolithic engine every cluster's greedy output is compared with."""
    return Engine(EngineConfig(model=checkpoint, dtype="float32", num_kv_blocks=2048))


@pytest.fixture()
def client(cluster):
    with Client(cluster.address, timeout=60) as c:
        yield c


def pytest_collection_modifyitems(session, config, items):
    """The modules that start a Ray instance of their own (they call ``own_ray``, which
    ends the suite's shared one) run last, in their order: the shared instance then
    starts once for every other module instead of again after each of them."""
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), "own_ray"))
