"""Runtime LoRA loads across the cluster's workers (``cluster.lora_admin``), against
workers that answer as engines do (``Engine.load_adapter``: a digest per file, the same
weights twice changing nothing, a refusal with a sentence; ``unload_adapter``): a load
serves everywhere or nowhere, the config new workers start from follows it, an unload
stops the routing first, and ``align`` brings a worker whose adapters drifted (a Ray
restart) back to those served. The engine's own part runs for real in
``tests/unit/engine/test_lora.py`` and through a cluster in
``tests/integration/test_cluster_lora.py``."""

from __future__ import annotations

import asyncio
import types

import pytest

from splitserve.cluster.config import ClusterConfig
from splitserve.cluster.lora_admin import LoRAAdmin
from splitserve.router.registry import Membership, WorkerRegistry
from splitserve.wire.engine_commands import LoadAdapter, UnloadAdapter
from splitserve.wire.errors import InvalidRequest, ModelLoadError, UnknownModel, WorkerLost

DIGESTS = {"/a/x": "d-x", "/a/y": "d-y"}  # what every worker reads at each path


class Worker:
    """A worker's engine as the admin sees it: adapters by name -> digest."""

    def __init__(self, files: dict[str, str] = DIGESTS):
        self.files, self.adapters, self.calls = files, {}, []

    async def change_adapters(self, change):
        self.calls.append(change)
        await asyncio.sleep(0)
        if isinstance(change, UnloadAdapter):
            if self.adapters.pop(change.name, None) is None:
                raise InvalidRequest(f"no LoRA adapter named {change.name!r} is loaded here")
            return None
        digest = self.files.get(change.path)
        if digest is None:
            raise ModelLoadError(
                f"LoRA adapter {change.name!r}: {change.path}/adapter_config.json is missing"
            )
        if self.adapters.get(change.name, digest) != digest:
            raise ModelLoadError(
                f"a LoRA adapter named {change.name!r} is loaded already, with other weights"
            )
        self.adapters[change.name] = digest
        return digest


class HungWorker(Worker):
    """A worker whose calls are never answered (its actor hangs)."""

    async def change_adapters(self, change):
        self.calls.append(change)
        await asyncio.Event().wait()


def _cluster(*workers: Worker, modules: dict[str, str] | None = None, call_timeout_s: float = 60.0):
    config = ClusterConfig.load()
    lora = {"enable_lora": True, "lora_modules": modules or {}, "max_loras": 4}
    config = config.model_copy(update={"model": config.model.model_copy(update=lora)})
    state = types.SimpleNamespace(config=config)
    registry = WorkerRegistry()
    for i, w in enumerate(workers):
        w.adapters = {n: DIGESTS[p] for n, p in (modules or {}).items()}
        record = registry.add(f"w{i}", "decode", w, 16)
        record.state = Membership.ACTIVE
    dispatcher = types.SimpleNamespace(served_model="base", adapters=tuple(modules or {}))
    reconfigure = lambda c: setattr(state, "config", c)  # noqa: E731
    admin = LoRAAdmin(lambda: state.config, reconfigure, registry, dispatcher, asyncio.Lock(), call_timeout_s)
    return admin, state, registry, dispatcher


def test_a_load_serves_on_every_worker_and_new_workers_start_with_it():
    workers = Worker(), Worker()
    admin, state, _, dispatcher = _cluster(*workers)
    asyncio.run(admin.load("x", "/a/x"))
    assert dispatcher.adapters == ("x",)
    assert all(w.adapters == {"x": "d-x"} for w in workers)
    assert state.config.model.lora_modules == {"x": "/a/x"}
    with pytest.raises(InvalidRequest, match="'x' is served already"):
        asyncio.run(admin.load("x", "/a/y"))
    with pytest.raises(InvalidRequest, match="'base' is served already"):
        asyncio.run(admin.load("base", "/a/y"))


def test_a_refusal_anywhere_serves_it_nowhere():
    good, bad = Worker(), Worker(files={})
    admin, state, _, dispatcher = _cluster(good, bad)
    with pytest.raises(InvalidRequest, match="w1 could not load it: .*adapter_config.json is missing"):
        asyncio.run(admin.load("x", "/a/x"))
    assert dispatcher.adapters == () and good.adapters == {} and bad.adapters == {}
    assert good.calls == [LoadAdapter("x", "/a/x"), UnloadAdapter("x")]
    assert state.config.model.lora_modules == {}


def test_workers_that_read_other_files_at_the_path_serve_it_nowhere():
    other = Worker(files={"/a/x": "d-other"})
    admin, state, _, dispatcher = _cluster(Worker(), other)
    with pytest.raises(InvalidRequest, match=r"read different files at /a/x \(w0: d-x, w1: d-other\)"):
        asyncio.run(admin.load("x", "/a/x"))
    assert dispatcher.adapters == () and other.adapters == {} and state.config.model.lora_modules == {}


def test_an_unload_stops_the_routing_then_unloads_everywhere():
    workers = Worker(), Worker()
    admin, state, _, dispatcher = _cluster(*workers, modules={"x": "/a/x", "y": "/a/y"})
    asyncio.run(admin.unload("x"))
    assert dispatcher.adapters == ("y",) and state.config.model.lora_modules == {"y": "/a/y"}
    assert all(w.adapters == {"y": "d-y"} for w in workers)
    with pytest.raises(UnknownModel, match="no LoRA adapter named 'x' is served"):
        asyncio.run(admin.unload("x"))


def test_align_brings_a_drifted_worker_back_to_the_adapters_served():
    """A worker Ray restarted came back with the adapters it was first started with."""
    kept, restarted, starting = Worker(), Worker(), Worker()
    admin, _, registry, _ = _cluster(kept, restarted, starting, modules={"x": "/a/x"})
    restarted.adapters = {"old": "d-old"}  # loaded at its first start, unloaded since
    registry.get("w2").state = Membership.STARTING  # not routed to yet: left alone
    for w in registry.workers():
        w.stats = types.SimpleNamespace(
            engine=types.SimpleNamespace(lora_adapters=tuple(w.client.adapters.items()))
        )
    assert asyncio.run(admin.align()) == 2
    assert restarted.calls == [LoadAdapter("x", "/a/x"), UnloadAdapter("old")]
    assert restarted.adapters == {"x": "d-x"} and kept.calls == [] and starting.calls == []


def test_a_worker_that_never_answers_refuses_the_load_within_the_timeout():
    good, hung = Worker(), HungWorker()
    admin, state, _, dispatcher = _cluster(good, hung, call_timeout_s=0.2)

    async def run():
        with pytest.raises(WorkerLost, match="w1 did not answer within 0.2 s"):
            await asyncio.wait_for(admin.load("x", "/a/x"), 30)

    asyncio.run(run())
    assert dispatcher.adapters == () and good.adapters == {} and state.config.model.lora_modules == {}
