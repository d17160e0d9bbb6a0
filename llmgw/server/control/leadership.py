"""Leadership between control planes on one store: a lease row (store/leases.py).

Without ``control.lease_ttl`` a control plane always leads: one control plane needs
nothing. With it, each process has a random owner id and tries to take the lease named
"leader"; the one that holds it leads, the others are standbys. The leader renews every
third of the TTL; a standby tries again every third of the TTL and also right after the
lease it saw runs out, so it takes over within about the TTL of the leader's death, and
within a third of it after a clean stop (the leader releases the lease on its way out).

Why two leaders cannot act at once. The store's expiry is the database's now *when the
claim ran* plus the TTL. Before sending a claim the leader notes its own monotonic clock,
t0; when the claim comes back granted, it leads until t0 + TTL - margin by its own clock.
The claim ran after t0, so the store's expiry lies at least ``margin`` after that local
deadline (clocks ticking at the same rate, which the margin covers for drift and for the
scheduling delay of stepping down). Nobody else can take the lease before the store's
expiry, since the claim statement refuses a live lease. So when a leader cannot reach the
store, it does not keep a claim it cannot prove: its renewals fail, its local deadline
passes, and it stops placing, stops sending to agents, closes their streams and refuses
admin writes, all before anyone else could have the lease. The only clock that decides
expiry is the database's; the two control planes' wall clocks never enter into it. What
is assumed: the database's clock does not jump forward by more than the margin within
one TTL (NTP slews rather than steps small corrections).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.store import Store

log = logging.getLogger("llmgw.control.leadership")

LEASE = "leader"
MIN_MARGIN_S = 0.25  # stepping down is a task switch and a few sends; drift is far smaller
MARGIN_SHARE = 0.05  # of the TTL: clock-rate differences over one lease


class Leadership:
    """Who leads: ``is_leader()`` answers from memory (no store round trip); listeners hear changes."""

    def __init__(
        self,
        store: Store | None,
        ttl: float | None,
        holder: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.holder = holder  # who we are, in words: shown by a standby refusing a write
        self.owner = secrets.token_hex(8)  # random per process: a restarted process is a new owner
        self.clock = clock
        self.margin = max(MIN_MARGIN_S, MARGIN_SHARE * ttl) if ttl else 0.0
        self._until: float | None = None  # local monotonic deadline of the lease we hold
        self._leading = ttl is None
        self._listeners: list[Callable[[bool], object]] = []
        self._task: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._running: set[asyncio.Future[object]] = set()  # listeners' coroutines, kept until done
        self.leader_holder: str | None = holder if ttl is None else None  # who leads, as last read
        # For the metrics: renewals (and first takes) that succeeded, claims that failed to reach
        # the store, and when the lease was last renewed (monotonic).
        self.renewals = 0
        self.failures = 0
        self.renewed_at: float | None = None

    @property
    def enabled(self) -> bool:
        return self.ttl is not None

    def is_leader(self) -> bool:
        if self.ttl is None:
            return True
        return self._leading and self._until is not None and self.clock() < self._until

    def on_change(self, listener: Callable[[bool], object]) -> None:
        """``listener(leading)`` each time this process starts or stops leading (a coroutine is run)."""
        self._listeners.append(listener)

    def seconds_since_renewal(self) -> float | None:
        return None if self.renewed_at is None else max(0.0, self.clock() - self.renewed_at)

    # -- lifetime -------------------------------------------------------------------------

    async def start(self) -> None:
        """Try once at once (so a lone control plane leads before it serves), then keep at it."""
        if self.ttl is None or self._task is not None:
            return
        await self._attempt()
        self._task = asyncio.create_task(self._loop(), name="leadership")
        self._watchdog = asyncio.create_task(self._watch(), name="leadership deadline")

    async def stop(self) -> None:
        """Stop trying; a leader gives the lease up so a standby takes over at once."""
        for task in (self._task, self._watchdog):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._task, self._watchdog) if t is not None), return_exceptions=True)
        self._task = self._watchdog = None
        if self.ttl is None or self.store is None:
            return
        was = self.is_leader()
        self._set(False, "stopping")
        if was:
            try:
                async with asyncio.timeout(self.ttl / 3):
                    await self.store.lease_release(LEASE, self.owner)
                log.info("released the leader lease")
            except Exception as exc:  # the lease then lapses on its own within the TTL
                log.warning("could not release the leader lease (%s); it lapses within %gs", exc, self.ttl)

    # -- the loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        assert self.ttl is not None
        while True:
            await self._sleep(self.ttl / 3)
            await self._attempt()

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass

    async def _attempt(self) -> None:
        """One claim: take or renew. A claim that does not come back within a third of the TTL
        counts as failed; the deadline of a lease already held stands (the watchdog ends it)."""
        assert self.ttl is not None and self.store is not None
        t0 = self.clock()
        try:
            async with asyncio.timeout(self.ttl / 3):
                got = await self.store.lease_claim(LEASE, self.owner, self.holder, self.ttl)
        except Exception as exc:  # the store unreachable, a timeout: nothing proven either way
            self.failures += 1
            left = (self._until - self.clock()) if self.is_leader() and self._until is not None else None
            if left is not None:
                log.warning("could not renew the leader lease (%s); leading for %.1fs more unless renewed", exc, left)
            else:
                log.warning("could not reach the store to claim the leader lease: %s", exc)
            return
        if got:
            self.renewals += 1
            self.renewed_at = self.clock()
            self._until = t0 + self.ttl - self.margin
            self.leader_holder = self.holder
            self._set(True, "took the leader lease")
            return
        self._until = None
        self._set(False, "another control plane holds the leader lease")
        await self._read_leader()

    async def _read_leader(self) -> None:
        """Who leads, for messages, and when their lease runs out, so the next try comes right after."""
        assert self.store is not None and self.ttl is not None
        try:
            async with asyncio.timeout(self.ttl / 3):
                lease = await self.store.lease_read(LEASE)
        except Exception:  # only words and a shorter wait are lost
            return
        if lease is None:
            self.leader_holder = None
            self._wake.set()  # released: try again now
            return
        self.leader_holder = lease.holder
        left = lease.expires_at - lease.now
        if 0 < left < self.ttl / 3:
            asyncio.get_running_loop().call_later(left + 0.05, self._wake.set)

    async def _watch(self) -> None:
        """End leadership at the local deadline even while a claim hangs."""
        while True:
            until = self._until
            wait = (until - self.clock()) if (self._leading and until is not None) else None
            if wait is not None and wait <= 0:
                self._set(False, "the leader lease could not be renewed in time")
                self._until = None
                continue
            await asyncio.sleep(min(wait, 0.5) if wait is not None else 0.5)

    def _set(self, leading: bool, why: str) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        if leading:
            log.warning("this control plane leads now (%s)", why)
        else:
            log.warning("this control plane is a standby now (%s)", why)
        for listener in self._listeners:
            try:
                got = listener(leading)
            except Exception:
                log.exception("a leadership listener failed")
                continue
            if asyncio.iscoroutine(got):
                task = asyncio.ensure_future(got)
                self._running.add(task)
                task.add_done_callback(self._running.discard)
                task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Future[object]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a leadership listener failed", exc_info=task.exception())


def holder_words(admin_listen: object) -> str:
    """Who this process is, as a standby names the leader: the host and its admin address."""
    return f"{socket.gethostname()} (admin {admin_listen})"


class LeadershipCollector:
    """llmgw_leader and the lease's renewals, failures and age, read at scrape time."""

    def __init__(self, leadership: Leadership) -> None:
        self._lead = leadership

    def collect(self) -> Iterable[Metric]:
        lead = self._lead
        yield GaugeMetricFamily(
            "llmgw_leader",
            "1 on the control plane that leads (always 1 without control.lease_ttl).",
            value=1.0 if lead.is_leader() else 0.0,
        )
        if not lead.enabled:
            return
        yield CounterMetricFamily(
            "llmgw_leader_lease_renewals",
            "Claims of the leader lease that were granted (takes and renewals).",
            value=lead.renewals,
        )
        yield CounterMetricFamily(
            "llmgw_leader_lease_failures",
            "Claims of the leader lease that did not reach the store in time.",
            value=lead.failures,
        )
        age = lead.seconds_since_renewal()
        if age is not None:
            yield GaugeMetricFamily(
                "llmgw_leader_lease_age_seconds", "Seconds since this process last renewed the leader lease.", value=age
            )
