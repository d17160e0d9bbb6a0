"""The leader's ready replicas, shared through the store so a standby's gateway serves them too.

Only the leader holds agents' streams, so only it knows which replicas are ready and where.
Every second it writes that list to the store (only when it changed, and only while it
holds the lease: the write checks the lease in the same transaction); a standby reads it
every second and keeps its gateway's endpoints equal to it. So clients of either control
plane are served throughout a failover: the standby already routes to the replicas when
it takes over, and keeps doing so while its reconciler adopts them.

A standby also reads the catalog again every few seconds (models added, scaled or removed
at run time through the leader are rows in the store), so its gateway serves the same
models and its reconciler starts from the catalog as it is when it takes over.

A control plane that has just taken the lease publishes nothing for ``settle`` seconds:
its reconciler knows no replica until the agents have reconnected and described their
shards, and publishing its empty list would take the replicas away from every standby.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from llmgw.server.control.leadership import LEASE, Leadership
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet
from llmgw.store import PublishedEndpoint, Store

log = logging.getLogger("llmgw.control.shared")

INTERVAL_S = 1.0
CATALOG_EVERY_S = 5.0  # a standby's catalog follows the leader's this closely


class SharedEndpoints:
    def __init__(
        self,
        store: Store,
        leadership: Leadership,
        endpoints: EndpointSet,
        ready: Callable[[], Iterable[PublishedEndpoint]],
        *,
        settle: float,
        breaker: tuple[int, float],
        follow_catalog: Callable[[], Awaitable[None]] | None = None,
        interval: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.leadership = leadership
        self.endpoints = endpoints
        self.ready = ready  # the reconciler's ready replicas, as rows
        self.settle = settle
        self.breaker = breaker
        self.interval = interval
        self.clock = clock
        self.follow_catalog = follow_catalog
        self._catalog_read: float | None = None
        self._leading_since: float | None = clock() if leadership.is_leader() else None
        self._written: list[PublishedEndpoint] | None = None
        self._followed: dict[str, Endpoint] = {}  # replica id -> the endpoint served from the store's list
        self._task: asyncio.Task | None = None
        self._complained = False
        leadership.on_change(self._changed)

    def _changed(self, leading: bool) -> None:
        self._leading_since = self.clock() if leading else None
        self._written = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="shared endpoints")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await self.step()
                self._complained = False
            except Exception as exc:  # the store away: what is served stays as it was
                if not self._complained:
                    log.warning("could not share replica endpoints through the store: %s", exc)
                    self._complained = True
            await asyncio.sleep(self.interval)

    async def step(self) -> None:
        if self.leadership.is_leader():
            await self._publish()
        else:
            await self._follow()

    async def _publish(self) -> None:
        since = self._leading_since
        if since is None or self.clock() - since < self.settle:
            return  # still adopting: what the standby serves stays until the list is whole
        # The reconciler's own endpoints serve from now on; the ones followed from the store go.
        self._drop_followed()
        rows = sorted(self.ready(), key=lambda r: r.replica_id)
        if rows == self._written:
            return
        if await self.store.endpoints_publish(rows, LEASE, self.leadership.owner):
            self._written = rows

    async def _follow(self) -> None:
        now = self.clock()
        if self.follow_catalog is not None and (
            self._catalog_read is None or now - self._catalog_read >= CATALOG_EVERY_S
        ):
            self._catalog_read = now
            await self.follow_catalog()
        rows = {r.replica_id: r for r in await self.store.endpoints_published()}
        for rid in [rid for rid in self._followed if rid not in rows]:
            self.endpoints.remove(self._followed.pop(rid))
        failures, cooldown = self.breaker
        for rid, r in rows.items():
            have = self._followed.get(rid)
            if have is not None and (have.url, have.model) == (r.url, r.model):
                continue
            if have is not None:
                self.endpoints.remove(have)
            ep = Endpoint(r.model, r.url, r.engine, None, failures, cooldown, api_key=r.api_key)
            # The leader saw it ready; this gateway's own probe keeps watching from here.
            ep.healthy = True
            ep.health_detail = f"ready (replica {rid}, as the leader published it)"
            self._followed[rid] = ep
            self.endpoints.add(ep)

    def _drop_followed(self) -> None:
        for ep in self._followed.values():
            self.endpoints.remove(ep)
        self._followed.clear()
