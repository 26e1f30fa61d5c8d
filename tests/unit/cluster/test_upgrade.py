"""The rolling upgrade's order and its rollback (``cluster.upgrade``), over fake pools
that record what they are asked (a stand-in for ``WorkerPool`` in this test of the
upgrade's own logic; the live cluster's run is tests/integration/test_rolling_upgrade.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.upgrade import rolling_upgrade


@dataclass
class _Worker:
    worker_id: str
    revision: str


@dataclass
class FakePool:
    role: str
    config: ClusterConfig
    workers: list[_Worker]
    log: list[str]
    fail_on_add: int | None = None  # the add call (1-based) that raises
    adds: int = 0
    next_index: int = 10
    removed: list[tuple[str, str]] = field(default_factory=list)

    def reconfigure(self, config: ClusterConfig) -> None:
        self.config = config
        self.log.append(f"{self.role}: reconfigure {config.model.name}")

    async def add(self, n: int) -> list[_Worker]:
        self.adds += 1
        if self.adds == self.fail_on_add:
            raise RuntimeError(f"{self.role} worker did not start")
        new = [_Worker(f"{self.role}-{self.next_index + i}", self.config.model.name) for i in range(n)]
        self.next_index += n
        self.workers += new
        self.log.append(f"{self.role}: add {[w.worker_id for w in new]}")
        return new

    async def remove(self, worker_id: str, drain_timeout_s: float, drain: str = "wait") -> None:
        self.workers = [w for w in self.workers if w.worker_id != worker_id]
        self.removed.append((worker_id, drain))
        self.log.append(f"{self.role}: remove {worker_id} ({drain})")


def _pools(log: list[str], old: ClusterConfig) -> dict[str, FakePool]:
    return {
        "prefill": FakePool("prefill", old, [_Worker("prefill-0", "A"), _Worker("prefill-1", "A")], log),
        "decode": FakePool("decode", old, [_Worker("decode-0", "A")], log),
    }


OLD = ClusterConfig.model_validate({"model": {"name": "A"}})
NEW = ClusterConfig.model_validate({"model": {"name": "B"}})


def test_each_batch_starts_new_workers_before_old_ones_go():
    log: list[str] = []
    pools = _pools(log, OLD)
    report = asyncio.run(rolling_upgrade(pools, NEW, pace=1, drain_timeout_s=5.0, progress=log.append))
    assert [w.revision for p in pools.values() for w in p.workers] == ["B", "B", "B"]
    assert report.removed == ["prefill-0", "decode-0", "prefill-1"]
    assert set(report.revisions.values()) == {"B"} and len(report.started) == 3
    first_removal = next(i for i, line in enumerate(log) if ": remove " in line)
    assert sum(": add " in line for line in log[:first_removal]) == 2  # a new prefill and decode serve first
    assert all(drain == "migrate" for p in pools.values() for _, drain in p.removed)


def test_a_failed_upgrade_rolls_back_to_the_old_config_and_sizes():
    log: list[str] = []
    pools = _pools(log, OLD)
    pools["prefill"].fail_on_add = 2  # the second batch's prefill worker does not start
    with pytest.raises(RuntimeError, match="did not start"):
        asyncio.run(rolling_upgrade(pools, NEW, pace=1, drain_timeout_s=5.0, progress=log.append))
    for pool in pools.values():
        assert pool.config is OLD  # new workers are built from the old config again
    # the old workers stopped in the first batch are replaced by old-config ones; the new ones are gone
    assert sorted(w.revision for w in pools["prefill"].workers) == ["A", "A"]
    assert [w.revision for w in pools["decode"].workers] == ["A"]
    assert any("rolling back" in line for line in log)


def test_a_pace_below_one_or_a_missing_pool_is_refused():
    with pytest.raises(ValueError, match="pace must be at least 1"):
        asyncio.run(rolling_upgrade(_pools([], OLD), NEW, pace=0))
    colocated = ClusterConfig.model_validate({"mode": "colocated", "model": {"name": "B"}})
    with pytest.raises(ValueError, match="no decode, prefill pool"):
        asyncio.run(rolling_upgrade(_pools([], OLD), colocated))
