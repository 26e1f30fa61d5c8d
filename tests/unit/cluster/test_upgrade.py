"""The rolling upgrade's order and its rollback (``cluster.upgrade``), over fake pools
that record what they are asked (a stand-in for ``WorkerPool`` in this test of the
upgrade's own logic; the live cluster's run is tests/integration/test_rolling_upgrade.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.room import WorkerNeed, fits
from splitserve.cluster.upgrade import PoolView, Way, plan_upgrade, rolling_upgrade
from splitserve.wire.errors import PreconditionFailed


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


def test_in_place_each_pool_lets_an_old_worker_go_before_its_replacement_starts():
    log: list[str] = []
    pools = _pools(log, OLD)
    pools["decode"].workers.append(_Worker("decode-1", "A"))
    report = asyncio.run(
        rolling_upgrade(pools, NEW, pace=1, drain_timeout_s=5.0, progress=log.append, way=Way.IN_PLACE)
    )
    assert [w.revision for p in pools.values() for w in p.workers] == ["B", "B", "B", "B"]
    changes = [line for line in log if ": add " in line or ": remove " in line]
    assert changes == [
        "prefill: remove prefill-0 (migrate)",
        "prefill: add ['prefill-10']",
        "decode: remove decode-0 (migrate)",
        "decode: add ['decode-10']",
        "prefill: remove prefill-1 (migrate)",
        "prefill: add ['prefill-11']",
        "decode: remove decode-1 (migrate)",
        "decode: add ['decode-11']",
    ]
    assert report.removed == ["prefill-0", "decode-0", "prefill-1", "decode-1"]
    assert any("prefill-10 serving" in line for line in log) and any(
        "decode-0 stopped" in line for line in log
    )


def test_a_failed_in_place_upgrade_removes_the_new_workers_before_old_ones_start_again():
    log: list[str] = []
    pools = _pools(log, OLD)
    pools["decode"].workers.append(_Worker("decode-1", "A"))
    pools["decode"].fail_on_add = 1  # the first new decode worker does not start
    with pytest.raises(RuntimeError, match="did not start"):
        asyncio.run(
            rolling_upgrade(pools, NEW, pace=1, drain_timeout_s=5.0, way=Way.IN_PLACE, progress=log.append)
        )
    back = log[next(i for i, line in enumerate(log) if "rolling back" in line) :]
    changes = [line for line in back if ": add " in line or ": remove " in line]
    assert changes == [
        "prefill: remove prefill-10 (wait)",
        "prefill: add ['prefill-11']",
        "decode: add ['decode-10']",
    ]
    assert sorted(w.revision for p in pools.values() for w in p.workers) == ["A"] * 4


def _need(role: str, cpus: float) -> WorkerNeed:
    return WorkerNeed(role, 1, (("CPU", cpus),))


def _views(prefill: int, decode: int, new_cpus: float = 1.0) -> list[PoolView]:
    return [
        PoolView(
            "prefill",
            [(f"p{i}", "n1") for i in range(prefill)],
            _need("prefill", 1),
            _need("prefill", 1),
            True,
        ),
        PoolView(
            "decode",
            [(f"d{i}", "n1") for i in range(decode)],
            _need("decode", 1),
            _need("decode", new_cpus),
            False,
        ),
    ]


def test_the_upgrade_surges_where_a_batch_fits_beside_the_old_workers():
    assert plan_upgrade(_views(1, 1), 1, {"n1": {"CPU": 2.0}}, room_known=True) is Way.SURGE
    assert (
        plan_upgrade(_views(1, 1), 1, {"n1": {"CPU": 1.0}, "n2": {"CPU": 1.0}}, room_known=True) is Way.SURGE
    )
    # room unknown (Ray's autoscaler may add a node): a surge is tried
    assert plan_upgrade(_views(1, 1), 1, {"n1": {"CPU": 0.0}}, room_known=False) is Way.SURGE


def test_with_no_room_to_surge_it_replaces_in_place_where_every_pool_can_spare_a_worker():
    assert plan_upgrade(_views(1, 2), 1, {"n1": {"CPU": 0.0}}, room_known=True) is Way.IN_PLACE
    # a surge of one prefill and one decode worker needs 2 CPUs; 1.5 are free
    assert plan_upgrade(_views(2, 2), 1, {"n1": {"CPU": 1.5}}, room_known=True) is Way.IN_PLACE


def test_an_upgrade_that_neither_way_can_run_is_refused_at_once_saying_what_it_needs():
    with pytest.raises(PreconditionFailed) as caught:  # the default cluster on 2 CPUs
        plan_upgrade(_views(1, 1), 1, {"n1abcdef99": {"CPU": 0.0}}, room_known=True)
    message = str(caught.value)
    assert "1 decode worker(s) of 1 x {CPU: 1}" in message and "node n1abcdef: CPU 0" in message
    assert "leave the decode pool with no worker (it has 1" in message and "nothing was changed" in message
    with pytest.raises(
        PreconditionFailed, match=r"cannot hold 1 x \(1 x \{CPU: 2\}\)"
    ):  # a bigger new worker
        plan_upgrade(_views(1, 2, new_cpus=2.0), 1, {"n1": {"CPU": 0.5}}, room_known=True)


def test_room_places_each_worker_whole_on_one_node():
    two_ranks = WorkerNeed("decode", 2, (("CPU", 1.0),))
    assert not fits([two_ranks], {"a": {"CPU": 1.0}, "b": {"CPU": 1.0}})  # 2 CPUs, but on two nodes
    assert fits([two_ranks], {"a": {"CPU": 1.0}, "b": {"CPU": 2.0}})
    assert fits([_need("p", 0.5), _need("d", 0.5)], {"a": {"CPU": 1.0}})
    assert not fits([_need("p", 0.5), _need("d", 0.75)], {"a": {"CPU": 1.0}})
    gpu = WorkerNeed("decode", 1, (("CPU", 1.0), ("GPU", 1.0)))
    assert not fits([gpu], {"a": {"CPU": 8.0}}) and fits([gpu], {"a": {"CPU": 1.0, "GPU": 1.0}})
