"""Runtime LoRA loads and unloads that reach a router other than the primary.

Routers share their HTTP port (``router.replicas``, node routers), so a
``POST /v1/load_lora_adapter`` lands on whichever one the kernel or the load
balancer picked. Only the primary changes what the cluster serves
(``cluster.lora_admin.LoRAAdmin``: the pools' config, every worker, one change at a
time). Another router passes the change to it through the **desk**, a Ray actor on
the primary's node that the primary creates with its routers:

- the router (``ForwardedAdapters``, its HTTP door's ``AdapterAdmin``) calls
  ``desk.load`` / ``desk.unload``, which wait until the primary has made the change
  and return its refusal (a ``SplitserveError``, raised again there: the same HTTP
  status and sentence as the primary's own door gives) or None;
- the primary (``serve_desk``) takes each change from the desk in turn, makes it
  with its ``LoRAAdmin`` (shielded: begun, it runs to its end) and hands back the
  outcome.

Before the primary answers a change (its own door's or the desk's), every router
serves the result (``LoRAAdmin.spread``). A desk that does not answer (the primary is
gone: it takes the desk with it) is ``WorkerLost`` (503): the cluster is then without
the router that owns its pools, whatever became of the change.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import ray

from splitserve.router.openai.server import AdapterAdmin
from splitserve.wire.errors import SplitserveError, WorkerLost

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterChange:
    """One change a router asked for: load ``name`` from ``path``, or (``path`` None)
    unload it. ``number`` pairs the outcome with the caller."""

    number: int
    name: str
    path: str | None


class AdapterDesk:
    """The desk (a Ray actor; see the module docstring). Routers ``load`` and ``unload``;
    the primary takes ``next`` and answers ``done``."""

    def __init__(self) -> None:
        self._changes: asyncio.Queue[AdapterChange] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future] = {}
        self._numbered = 0

    async def load(self, name: str, path: str) -> SplitserveError | None:
        """Wait until the primary has loaded ``name`` from ``path``; its refusal or None."""
        return await self._ask(name, path)

    async def unload(self, name: str) -> SplitserveError | None:
        """Wait until the primary has unloaded ``name``; its refusal or None."""
        return await self._ask(name, None)

    async def next(self) -> AdapterChange:
        """The next change asked for, in order (the primary's; waits for one)."""
        return await self._changes.get()

    async def done(self, number: int, refusal: SplitserveError | None) -> None:
        """Change ``number`` is made (``refusal`` None) or refused."""
        waiting = self._waiting.pop(number, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(refusal)

    async def forwarded(self) -> int:
        """Changes asked for so far (tests)."""
        return self._numbered

    async def _ask(self, name: str, path: str | None) -> SplitserveError | None:
        self._numbered += 1
        waiting = asyncio.get_running_loop().create_future()
        self._waiting[self._numbered] = waiting
        self._changes.put_nowait(AdapterChange(self._numbered, name, path))
        return await waiting


class ForwardedAdapters:
    """A router's ``AdapterAdmin`` where another router (the primary) makes the change,
    through ``desk``."""

    def __init__(self, desk: Any):
        self.desk = desk

    async def load(self, name: str, path: str) -> None:
        await self._ask(self.desk.load.remote(name, path))

    async def unload(self, name: str) -> None:
        await self._ask(self.desk.unload.remote(name))

    @staticmethod
    async def _ask(call: Any) -> None:
        try:
            refusal = await call
        except ray.exceptions.RayError as e:
            raise WorkerLost(
                f"the cluster's first router, which loads and unloads LoRA adapters, did not answer ({e})"
            ) from None
        if refusal is not None:
            raise refusal


async def serve_desk(desk: Any, lora: AdapterAdmin) -> None:
    """The primary's side, until cancelled or the desk is gone: each change the desk
    holds, made with ``lora`` in the order asked, its outcome handed back (a failure
    other than a ``SplitserveError`` too, as one: a router's caller never waits on a
    change that ended). Whoever cancels it kills the desk (``Replicas.stop``), so the
    routers waiting on it get ``WorkerLost`` rather than wait on."""
    while True:
        try:
            change = await desk.next.remote()
        except ray.exceptions.RayError as e:
            log.warning("the LoRA adapter desk is gone (%s); other routers cannot change adapters", e)
            return
        refusal = None
        try:
            if change.path is None:
                await asyncio.shield(lora.unload(change.name))
            else:
                await asyncio.shield(lora.load(change.name, change.path))
        except SplitserveError as e:
            refusal = e
        except Exception as e:  # never expected: the router says so rather than wait
            log.exception("LoRA adapter change %s failed", change)
            refusal = SplitserveError(f"the LoRA adapter change failed: {type(e).__name__}: {e}")
        try:
            await desk.done.remote(change.number, refusal)
        except ray.exceptions.RayError:
            return
