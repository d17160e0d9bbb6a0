"""Keeping CPython's full garbage collections off a large, long-lived registry.

The cyclic collector walks every object it tracks on each full (generation 2) collection. A control
plane with 10,000 agents connected holds about two million long-lived objects (node records with
their inventories, TLS sessions, WebSocket streams), and while a fleet registers, full collections keep
coming: measured in-process, their time per registration grew from 48 µs at 1,000 nodes to 218 µs at
10,000, which made a connection storm cost more per agent the larger the fleet.

``gc.freeze()`` moves everything the collector tracks into a permanent generation it no longer walks.
Freezing each time the registry has grown by a step (``first`` nodes, or a quarter of what was frozen
when that is more) leaves each collection walking only what arrived since, so a registration costs the
same whatever the fleet's size.

Frozen objects are still freed by reference counting; only cycles among them are not. A closed stream
leaves such cycles (transport, protocol, WebSocket, futures), so the owner says each time it lets one
go, and once a step's worth have gone the freezer thaws, in its own task a moment later (the closing
code still holds what it let go when it says so): unfreeze, one full collection, freeze again. That
pause grows with the registry but comes once per step of churn, so per agent it stays flat; a
thaw also comes every ``thaw_interval`` seconds when anything at all was let go since the last.

The collector is the process's, so the process owner (the server) makes one freezer and hands it to
the registry it is for. A thaw also unfreezes what the server froze once at start-up (its modules and
configuration), and freezes it again with the rest.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("llmgw.gcfreeze")


class GcFreezer:
    def __init__(
        self, *, first: int = 1000, growth: float = 0.25, thaw_interval: float = 1800.0, settle: float = 1.0
    ) -> None:
        if first < 1:
            raise ValueError(f"first must be at least 1, not {first}")
        if growth < 0:
            raise ValueError(f"growth must be 0 or more, not {growth}")
        if thaw_interval <= 0:
            raise ValueError(f"thaw_interval must be above 0, not {thaw_interval}")
        if settle < 0:
            raise ValueError(f"settle must be 0 or more, not {settle}")
        self.first = first
        self.growth = growth
        self.thaw_interval = thaw_interval
        self.settle = settle
        self.frozen_size = 0  # the registry's size at the last freeze; 0 while nothing is frozen
        self.released_since = 0  # long-lived things let go since the last freeze or thaw
        self.freezes = 0
        self.thaws = 0
        self._last_thaw = time.monotonic()
        self._due = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def step(self) -> int:
        """How much the registry grows, or how many of its things are let go, before the next freeze or thaw."""
        return max(self.first, int(self.frozen_size * self.growth))

    def grew(self, size: int) -> bool:
        """The registry holds ``size`` things now: freeze when it has grown a step since the last freeze."""
        if size < self.frozen_size + self.step():
            return False
        started = time.perf_counter()
        # What is garbage already is collected first, not frozen with the rest; the collection walks
        # only what was not frozen before, so its cost is the step's, not the registry's.
        gc.collect()
        gc.freeze()
        pause = time.perf_counter() - started
        self.frozen_size = size
        self.freezes += 1
        log.info(
            "registry at %d: %d objects frozen out of full garbage collections (%.0f ms)",
            size,
            gc.get_freeze_count(),
            pause * 1000,
        )
        return True

    def released(self, count: int = 1) -> bool:
        """``count`` long-lived things (a closed stream) were let go. Once a step's worth have been,
        a thaw is due (True): the thaw loop runs it ``settle`` seconds later, once the code letting
        them go has finished with them (a stream's handler still holds it when it says so)."""
        if not self.frozen_size:
            return False
        self.released_since += count
        if self.released_since < self.step():
            return False
        self._due.set()
        return True

    @property
    def due(self) -> bool:
        """A step's worth have been let go and the thaw loop has not thawed yet."""
        return self._due.is_set()

    def periodic(self) -> bool:
        """The thaw loop's check, every ``thaw_interval`` or when a thaw is due: thaw (True) when
        anything was let go since the last thaw. A fleet that let nothing go is left unpaused:
        closed streams are what leaves frozen cycles; whatever else was frozen in flight is bounded
        by the few moments a freeze or thaw happened at."""
        self._due.clear()
        if self.frozen_size and self.released_since:
            self.thaw()
            return True
        self._last_thaw = time.monotonic()
        return False

    def thaw(self) -> None:
        """Unfreeze, collect everything once (the cycles frozen objects left behind) and freeze again."""
        if not self.frozen_size:
            return
        started = time.perf_counter()
        gc.unfreeze()
        freed = gc.collect()
        gc.freeze()
        pause = time.perf_counter() - started
        self.released_since = 0
        self._due.clear()
        self.thaws += 1
        self._last_thaw = time.monotonic()
        log.info(
            "thawed the frozen heap: %d unreachable objects collected in %.0f ms, %d frozen again",
            freed,
            pause * 1000,
            gc.get_freeze_count(),
        )

    # -- the periodic thaw ---------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._thaw_loop(), name="gc thaw")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _thaw_loop(self) -> None:
        while True:
            # Every thaw_interval from the last thaw, or sooner when enough was let go.
            wait = max(0.0, self._last_thaw + self.thaw_interval - time.monotonic())
            try:
                await asyncio.wait_for(self._due.wait(), wait)
                await asyncio.sleep(self.settle)
            except TimeoutError:
                pass
            self.periodic()
