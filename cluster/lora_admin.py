"""LoRA adapters loaded and unloaded while the cluster serves: on every worker of every
pool, as vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` do on
its one server.

The primary router owns the set of adapters the cluster serves (its dispatcher's
``adapters``). A change asked of another router reaches it through the desk
(``cluster.adapter_desk``), and every other router serves the change before it is
answered (``spread``: ``Replicas.spread_adapters``), so that the next request anywhere
finds it.

- **Load**: refused (``InvalidRequest``, nothing changed) where LoRA is off
  (``model.enable_lora``), for a name already served (or the served model's), or for
  a config the pools would not start from (more adapters than ``max_loras``). The
  pools' config names the adapter first, so that a worker started from then on (a
  replacement, the autoscaler's, an upgrade's) loads it at start; then every worker
  loads it, all at once (each engine on every rank of its TP group:
  ``Engine.load_adapter``); a worker that had it from its config already answers
  alike. If one refuses, or two read different files at the path (their digests
  differ), those that loaded it unload it, the config is restored, and the refusal's
  sentence is the answer. Only then does the router route to it.
- **Unload**: the router stops routing to it first (a request naming it from then on
  is ``NOT_FOUND``), the config drops it, then every worker unloads it; the requests
  running under it finish under it (``Engine.unload_adapter``).
- **Kept in step** (``keep``): every ``KEEP_S``, an active worker whose adapters (its
  last stats) are not the ones served loads the missing and unloads the others: a
  worker Ray restarted comes back with the adapters it was first started with, and one
  started while a change ran may have missed it.

One change at a time, and none during a rolling upgrade (they share its lock). A
change runs to its end once begun, even if the caller leaves (the HTTP door shields it),
and a worker that does not answer within ``CALL_TIMEOUT_S`` refuses the load
(``WorkerLost``, 503: nothing served) or is left to ``align`` (an unload).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from splitserve.cluster.config import ClusterConfig
from splitserve.router.dispatch import Dispatcher
from splitserve.router.registry import Membership, WorkerRecord, WorkerRegistry
from splitserve.wire.engine_commands import LoadAdapter, UnloadAdapter
from splitserve.wire.errors import InvalidRequest, ModelLoadError, UnknownModel, WorkerLost

log = logging.getLogger(__name__)

KEEP_S = 5.0  # how often the workers' adapters are checked against those served
# how long one worker may take to load or unload an adapter (a starting one answers once
# its model is loaded); past it the change is refused, or (an unload) left to ``align``
CALL_TIMEOUT_S = 120.0


class LoRAAdmin:
    def __init__(
        self,
        config: Callable[[], ClusterConfig],
        reconfigure: Callable[[ClusterConfig], None],
        registry: WorkerRegistry,
        dispatcher: Dispatcher,
        changing: asyncio.Lock,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ):
        """``config``: the config the pools start workers from now; ``reconfigure``: start
        them from this one from now on (those running keep theirs); ``changing``: held
        while the cluster's config changes (a rolling upgrade holds it too)."""
        self._config, self._reconfigure = config, reconfigure
        self._registry, self._dispatcher = registry, dispatcher
        self._changing = changing
        self._call_timeout_s = call_timeout_s
        # tells every other router the adapters served now (set where there are others)
        self.spread: Callable[[tuple[str, ...]], Awaitable[None]] | None = None

    async def load(self, name: str, path: str) -> None:
        """Serve adapter ``name`` from ``path`` (a PEFT directory every worker's node can
        read) on every worker, or on none (see the module docstring)."""
        async with self._changing:
            config = self._config()
            if not config.model.enable_lora:
                raise InvalidRequest("this cluster serves no LoRA adapters: start it with --enable-lora")
            if not name or name == self._dispatcher.served_model or name in self._dispatcher.adapters:
                raise InvalidRequest(f"a model or LoRA adapter named {name!r} is served already")
            changed = _with_modules(config, {**config.model.lora_modules, name: path})
            self._reconfigure(changed)
            workers = self._registry.workers()
            outcomes = await asyncio.gather(
                *(self._change(w, LoadAdapter(name, path)) for w in workers), return_exceptions=True
            )
            loaded = {w.worker_id: d for w, d in zip(workers, outcomes) if not isinstance(d, BaseException)}
            refusal = next(((w, e) for w, e in zip(workers, outcomes) if isinstance(e, BaseException)), None)
            if refusal is None and len(set(loaded.values())) > 1:
                digests = ", ".join(f"{wid}: {d}" for wid, d in sorted(loaded.items()))
                error = InvalidRequest(f"the workers read different files at {path} ({digests})")
            elif refusal is not None:
                worker, error = refusal
                if isinstance(error, ModelLoadError | InvalidRequest):
                    error = InvalidRequest(f"{worker.worker_id} could not load it: {error}")
            else:
                await self._serve((*self._dispatcher.adapters, name))
                log.info("LoRA adapter %r from %s: loaded on %d worker(s)", name, path, len(workers))
                return
            await asyncio.gather(*(self._unload_on(w, name) for w in workers if w.worker_id in loaded))
            self._reconfigure(config)
            raise error

    async def unload(self, name: str) -> None:
        """Serve adapter ``name`` no more (see the module docstring). ``UnknownModel`` if
        it is not served."""
        async with self._changing:
            if name not in self._dispatcher.adapters:
                raise UnknownModel(f"no LoRA adapter named {name!r} is served")
            await self._serve(tuple(a for a in self._dispatcher.adapters if a != name))
            config = self._config()
            modules = {n: p for n, p in config.model.lora_modules.items() if n != name}
            self._reconfigure(_with_modules(config, modules))
            await asyncio.gather(*(self._unload_on(w, name) for w in self._registry.workers()))
            log.info("LoRA adapter %r unloaded", name)

    async def keep(self, interval_s: float = KEEP_S) -> None:
        """Forever: every ``interval_s``, ``align`` the active workers where one drifted
        (the lock is taken only then: an upgrade asked for meanwhile is not refused)."""
        while True:
            await asyncio.sleep(interval_s)
            if self._drifted() and not self._changing.locked():
                async with self._changing:
                    await self.align()

    async def align(self) -> int:
        """Each active worker whose last stats list other adapters than those served
        loads the missing (from the config's paths) and unloads the others; returns the
        changes made. What fails is logged and tried again next time."""
        changes = self._drifted()
        outcomes = await asyncio.gather(*(self._change(w, c) for w, c in changes), return_exceptions=True)
        for (w, change), outcome in zip(changes, outcomes):
            if isinstance(outcome, BaseException):
                log.warning("%s: %s failed: %s", w.worker_id, change, outcome)
            else:
                log.info("%s: %s (its adapters were not those served)", w.worker_id, change)
        return len(changes)

    async def _serve(self, adapters: tuple[str, ...]) -> None:
        """Route requests to ``adapters`` from now on, on this router and every other."""
        self._dispatcher.adapters = adapters
        if self.spread is not None:
            await self.spread(adapters)

    async def _change(self, record: WorkerRecord, change: LoadAdapter | UnloadAdapter) -> str | None:
        """``change`` on ``record``'s worker; ``WorkerLost`` if it does not answer within
        the call timeout (a change never holds the lock, or its caller, for longer)."""
        try:
            return await asyncio.wait_for(record.client.change_adapters(change), self._call_timeout_s)
        except TimeoutError:
            raise WorkerLost(
                f"{record.worker_id} did not answer within {self._call_timeout_s:g} s (LoRA adapter "
                f"{change.name!r})"
            ) from None

    async def _unload_on(self, record: WorkerRecord, name: str) -> None:
        try:
            await self._change(record, UnloadAdapter(name))
        except Exception as e:  # lost meanwhile, or never had it: ``align`` sees to it
            log.warning("%s: unloading LoRA adapter %r failed: %s", record.worker_id, name, e)

    def _drifted(self) -> list[tuple[WorkerRecord, LoadAdapter | UnloadAdapter]]:
        """What ``align`` would change: per active worker, the adapters served it lacks
        (with the config's path) and those it has that are not served."""
        served = set(self._dispatcher.adapters)
        paths = self._config().model.lora_modules
        changes: list[tuple[WorkerRecord, LoadAdapter | UnloadAdapter]] = []
        for w in self._registry.workers():
            if w.state != Membership.ACTIVE or w.stats is None:
                continue
            has = {n for n, _ in w.stats.engine.lora_adapters}
            changes += [(w, LoadAdapter(n, paths[n])) for n in sorted(served - has) if n in paths]
            changes += [(w, UnloadAdapter(n)) for n in sorted(has - served)]
        return changes


def _with_modules(config: ClusterConfig, modules: dict[str, str]) -> ClusterConfig:
    """``config`` whose workers start with LoRA adapters ``modules``; ``InvalidRequest``
    where a pool's engine would not start from it."""
    changed = config.model_copy(update={"model": config.model.model_copy(update={"lora_modules": modules})})
    for role in changed.pools():
        try:
            changed.engine_config(role)
        except ValueError as e:
            raise InvalidRequest(f"the pools could not start with these adapters: {e}") from None
    return changed
