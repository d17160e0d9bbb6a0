"""Admission: whether a request may go to a model's engines now, or must wait its turn.

A model's endpoints form one pool. Its *saturation* is the worse of two ratios
against what counts as healthy: requests waiting inside the engines (their own
queues) per endpoint against ``healthy_waiting``, and KV-cache use against
``kv_ceiling``; and where `ctl bench --save` measured the replicas' capacity, a third:
the requests in flight against it. 1.0 is the healthy limit, not the point of failure.

Below 1 a request passes at once (a synchronous check: the hot path awaits
nothing). At or above 1 it waits in the model's queue until it is admitted,
shed, timed out, or its client goes away. Waiters are admitted highest band
first; within a band the tenants with waiters take turns (FIFO within one
tenant), so one tenant's burst cannot starve another. When the queue is full
the lowest band gives way first: its busiest tenant's newest waiter is shed,
or the newcomer itself when it is no higher than every waiter.

Scraped numbers move only once per scrape interval, so the queue is not
emptied on one stale reading. Waiters are admitted:

* one per finished request (``release``) while the pool reads unsaturated:
  a replacement, which cannot raise the load above what was just measured;
* one per arrival while the pool reads unsaturated (the arrival joins the
  queue and the head of the queue goes, which is what the fast path would
  have let through, in the queue's order);
* on ``poke`` (after a scrape, when the numbers are new) as many as the
  measured headroom allows: ``(1 - saturation) x capacity`` requests, at
  least one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmgw.errors import LlmgwError
from llmgw.server.gateway.principal import BANDS, DEFAULT_BAND

if TYPE_CHECKING:
    from llmgw.config.server import AdmissionConfig
    from llmgw.server.gateway.endpoints import Endpoint, EndpointSet

log = logging.getLogger("llmgw.gateway.admission")

_RANK = {b: i for i, b in enumerate(BANDS)}


def band_rank(band: str) -> int:
    """0 for the lowest band; an unknown name counts as the default band."""
    return _RANK.get(band, _RANK[DEFAULT_BAND])


def effective_band(key_band: str, requested: str | None) -> str:
    """The band a request is admitted in: the key's, or a lower one the client asked
    for (a batch job may yield); a request can never raise itself above its key."""
    key_band = key_band if key_band in _RANK else DEFAULT_BAND
    if requested is None or requested not in _RANK:
        return key_band
    return requested if _RANK[requested] < _RANK[key_band] else key_band


# --- measuring a pool --------------------------------------------------------


def _measured(ep: Endpoint) -> bool:
    return ep.names is not None


def pool_saturation(
    endpoints: EndpointSet, model: str, healthy_waiting: float, kv_ceiling: float, *, now: float | None = None
) -> float:
    """How full a model's pool is; 1.0 is the healthy limit.

    The worse of
      * queue: requests waiting inside the engines, summed over the model's
        available endpoints, over ``healthy_waiting`` x their number;
      * KV: the endpoints' mean KV-cache use over ``kv_ceiling`` (the mean, not
        the worst one: the router sends new work to the least loaded
        endpoint, so one hot replica does not make the pool full).

    An endpoint's queue counts the gateway's own requests too, not only what
    its engine last reported waiting: scrapes come every second, the gateway's
    count moves with every request, so a burst that arrives between two scrapes
    is held here, in the gateway's queue with its bands and fairness, rather
    than piling up in the engine's. For an engine ever seen queueing (it has a
    fixed number of slots: the most it was seen running), every request in
    flight beyond those slots waits. For one never seen queueing (a fast
    engine, whose requests in flight are mostly on the wire), only what was
    sent since the last scrape beyond its free slots does. Scraped numbers are used while fresh
    (``router.metrics_stale_after``); when they are stale, the requests in
    flight beyond the engine's slots are taken to wait, and KV use is left out.
    An engine that publishes nothing at all (``openai``) is left out of both
    ratios: admission cannot know its capacity and does not hold traffic on a
    guess. Unavailable endpoints (unhealthy, breaker open) are left out; a
    model with none available reads 0, so its requests pass on to the proxy,
    which answers 503 or waits for a cold start as it does without admission.

    A measured capacity (``Endpoint.capacity``, from `ctl bench --save`: the most
    requests in flight at which a replica of the profile still met its latency target)
    is a third ratio: the gateway's requests in flight over the sum of the endpoints'
    capacities, so a pool at its measured concurrency is saturated. It counts only when
    every available endpoint has one (one without has headroom nobody measured, and
    admission does not guess), and for any engine, ``openai`` included.

    With workers (``endpoints.workers`` > 1) each process counts its own requests in flight
    against its share of every capacity and of the engine's slots, rounded up (``_share``).
    """
    now = time.monotonic() if now is None else now
    stale_after = endpoints.stale_after
    n = endpoints.workers
    waiting = 0.0
    counted = 0
    kv_sum = 0.0
    kv_n = 0
    capacity = 0.0  # the available endpoints' measured capacities, summed
    capacity_inflight = 0
    unmeasured = False  # an available endpoint without one
    for ep in endpoints.by_model.get(model, ()):
        if not ep.available(now):
            continue
        if ep.capacity:
            capacity += _share(ep.capacity, n)
            capacity_inflight += ep.inflight
        else:
            unmeasured = True
        if not _measured(ep):
            continue
        counted += 1
        running = ep.running or 0.0
        # With workers, each counts only its own in flight, against its share of the slots.
        beyond_slots = ep.inflight - _share(max(ep.slots_seen, running), n)
        if ep.metrics_stale(now, stale_after) or ep.waiting is None:
            # Only the gateway's count: what it has there beyond what the engine can run.
            waiting += max(0.0, beyond_slots)
        elif ep.queues_seen:
            # An engine seen queueing has a fixed number of slots: whatever the gateway has
            # there beyond them waits, whether or not the last scrape saw it arrive.
            waiting += max(0.0, ep.waiting, beyond_slots)
        else:
            # Never seen queueing (a fast engine, or one not yet loaded): its requests in flight
            # are mostly on the wire, so only what was sent since the scrape, beyond the slots
            # it had free then, is taken to wait. A first burst is held by this.
            free = _share(max(0.0, ep.slots_seen - running), n)
            sent_since = ep.inflight - ep.inflight_at_scrape
            waiting += max(0.0, ep.waiting, ep.waiting + sent_since - free)
            if ep.kv_usage is not None:
                kv_sum += ep.kv_usage
                kv_n += 1
    at_capacity = capacity_inflight / capacity if capacity and not unmeasured else 0.0
    if not counted:
        return at_capacity
    queue = waiting / (healthy_waiting * counted)
    kv = (kv_sum / kv_n) / kv_ceiling if kv_n else 0.0
    return max(queue, kv, at_capacity)


def pool_capacity(endpoints: EndpointSet, model: str, healthy_waiting: float, *, now: float | None = None) -> float:
    """The healthy limit of a model's pool in requests: ``healthy_waiting`` per available
    endpoint that publishes its load (what saturation 1.0 stands for); or, when every
    available endpoint has a measured capacity, the sum of those."""
    now = time.monotonic() if now is None else now
    available = [ep for ep in endpoints.by_model.get(model, ()) if ep.available(now)]
    if available and all(ep.capacity for ep in available):
        return float(sum(_share(ep.capacity or 0, endpoints.workers) for ep in available))
    return healthy_waiting * sum(1 for ep in available if _measured(ep))


def _share(x: float, workers: int) -> float:
    """One worker's part of an engine's capacity or slots: a whole share, rounded up, so no
    worker is held below one request (across N workers a pool admits up to N - 1 more than
    the capacity, which is the documented bound)."""
    return x if workers <= 1 else float(math.ceil(x / workers))


# --- the queue ---------------------------------------------------------------


class AdmissionRejected(LlmgwError):
    """Admission turned a request away: answer ``status`` with ``Retry-After``."""

    def __init__(
        self, message: str, *, band: str, reason: str, retry_after: float, status: int = 503, code: str = "overloaded"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.band = band
        self.reason = reason  # "queue_full", "shed" or "timeout"
        self.retry_after = retry_after
        self.status = status
        self.code = code

    def headers(self) -> dict[str, str]:
        """Retry-After in whole seconds, as HTTP wants it."""
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


@dataclass(slots=True, eq=False)
class Ticket:
    """A request's place in a model's pool; hand it back with ``Admission.release``."""

    model: str
    band: str
    tenant: str
    waited: float = 0.0  # seconds spent in the queue; 0 on the fast path
    released: bool = False


@dataclass(slots=True, eq=False)
class _Waiter:
    band: str
    tenant: str
    since: float
    future: asyncio.Future[Ticket]
    queued: bool = True


@dataclass(slots=True)
class _Pool:
    # One round-robin per band: tenant -> its waiters, oldest first. The first
    # tenant is next; after its turn it moves to the end.
    bands: list[OrderedDict[str, deque[_Waiter]]] = field(default_factory=lambda: [OrderedDict() for _ in BANDS])
    depth: int = 0
    inflight: int = 0  # tickets out and not yet released

    def depth_of(self, rank: int) -> int:
        return sum(len(q) for q in self.bands[rank].values())


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """What the metrics module exports."""

    queue_depth: dict[str, int]  # llmgw_admission_queue_depth{model}
    queue_depth_by_band: dict[tuple[str, str], int]  # (model, band) -> waiters
    saturation: dict[str, float]  # llmgw_pool_saturation{model}
    inflight: dict[str, int]  # admitted and not yet released, per model
    rejected: dict[str, int]  # llmgw_admission_rejected_total{band}, every band present


class Admission:
    """Per-model admission queues. One per gateway process; not thread-safe (one event loop)."""

    def __init__(
        self,
        config: AdmissionConfig,
        saturation: Callable[[str], float],
        *,
        capacity: Callable[[str], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._saturation = saturation
        self._capacity = capacity or (lambda _model: config.healthy_waiting)
        self._clock = clock
        self._pools: dict[str, _Pool] = {}
        self.rejected: dict[str, int] = dict.fromkeys(BANDS, 0)

    # The request path ------------------------------------------------------

    def try_admit(self, model: str, band: str, tenant: str) -> Ticket | None:
        """A ticket at once when the pool is unsaturated and nobody waits for it;
        None when the request must ``await wait(...)``. Never blocks."""
        band = band if band in _RANK else DEFAULT_BAND
        if not self.config.enabled:
            return self._ticket(model, band, tenant)
        pool = self._pools.get(model)
        if (pool is None or not pool.depth) and self._saturation(model) < 1.0:
            return self._ticket(model, band, tenant)
        return None

    async def wait(self, model: str, band: str, tenant: str) -> Ticket:
        """Queue the request and wait for its turn. Raises AdmissionRejected when it is
        turned away (queue full, shed for a higher band, queue_timeout passed);
        CancelledError (the client went away) takes it out of the queue."""
        band = band if band in _RANK else DEFAULT_BAND
        if not self.config.enabled:
            return self._ticket(model, band, tenant)
        loop = asyncio.get_running_loop()
        pool = self._pools.setdefault(model, _Pool())
        if pool.depth >= self.config.max_queue:
            self._make_room(model, pool, band)  # raises when the newcomer is the one to go
        w = _Waiter(band, tenant, self._clock(), loop.create_future())
        pool.bands[_RANK[band]].setdefault(tenant, deque()).append(w)
        pool.depth += 1
        if self._saturation(model) < 1.0:
            # An arrival on an unsaturated pool lets the head of the queue go, as
            # the fast path would have let the arrival itself go.
            self._admit(model, pool, 1)
        timer = loop.call_later(self.config.queue_timeout, self._expire, model, w)
        try:
            return await w.future
        except asyncio.CancelledError:
            self._leave(model, w)
            raise
        finally:
            timer.cancel()

    async def admit(self, model: str, band: str, tenant: str) -> Ticket:
        """try_admit, else wait."""
        ticket = self.try_admit(model, band, tenant)
        if ticket is not None:
            return ticket
        return await self.wait(model, band, tenant)

    def release(self, ticket: Ticket) -> None:
        """The request finished (or failed, or its client left): its place passes to the
        next waiter while the pool reads unsaturated. Calling it twice is harmless."""
        if ticket.released:
            return
        ticket.released = True
        pool = self._pools.get(ticket.model)
        if pool is None:
            return
        pool.inflight -= 1
        if pool.depth and self._saturation(ticket.model) < 1.0:
            self._admit(ticket.model, pool, 1)
        self._forget(ticket.model, pool)

    def poke(self, model: str) -> int:
        """New numbers for ``model`` (call after each scrape): admit waiters up to the
        measured headroom. Returns how many were admitted."""
        pool = self._pools.get(model)
        if pool is None or not pool.depth:
            return 0
        sat = self._saturation(model)
        if sat >= 1.0:
            return 0
        budget = max(1, math.floor((1.0 - sat) * self._capacity(model)))
        n = self._admit(model, pool, budget)
        self._forget(model, pool)
        return n

    def poke_all(self) -> int:
        """poke every model that has waiters."""
        return sum(self.poke(m) for m, p in list(self._pools.items()) if p.depth)

    async def run(self, interval: float) -> None:
        """poke_all every ``interval`` seconds, so waiters move even when no request
        finishes (the pool was filled by traffic from elsewhere)."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.poke_all()
            except Exception:  # a bad saturation reading must not stop the ticker
                log.exception("admission: poking the queues failed")

    # Metrics ----------------------------------------------------------------

    def queue_depth(self, model: str | None = None) -> int:
        if model is not None:
            pool = self._pools.get(model)
            return pool.depth if pool else 0
        return sum(p.depth for p in self._pools.values())

    def saturation(self, model: str) -> float:
        return self._saturation(model)

    def stats(self, models: list[str] | None = None) -> AdmissionStats:
        """Every number the metrics module exports. ``models``: the models to report
        saturation for (e.g. ``endpoints.by_model``); default: those admission has seen."""
        names = list(models) if models is not None else list(self._pools)
        depth = {m: self.queue_depth(m) for m in names}
        by_band = {}
        for m in names:
            pool = self._pools.get(m)
            for i, b in enumerate(BANDS):
                by_band[(m, b)] = pool.depth_of(i) if pool else 0
        return AdmissionStats(
            queue_depth=depth,
            queue_depth_by_band=by_band,
            saturation={m: self._saturation(m) for m in names},
            inflight={m: (self._pools[m].inflight if m in self._pools else 0) for m in names},
            rejected=dict(self.rejected),
        )

    # Inside -----------------------------------------------------------------

    def _ticket(self, model: str, band: str, tenant: str, waited: float = 0.0) -> Ticket:
        self._pools.setdefault(model, _Pool()).inflight += 1
        return Ticket(model, band, tenant, waited)

    def _forget(self, model: str, pool: _Pool) -> None:
        # Keep the map to models with something going on.
        if not pool.depth and not pool.inflight:
            self._pools.pop(model, None)

    def _unlink(self, pool: _Pool, w: _Waiter) -> None:
        rr = pool.bands[_RANK[w.band]]
        q = rr.get(w.tenant)
        if q is not None:
            try:
                q.remove(w)
            except ValueError:
                pass
            if not q:
                del rr[w.tenant]
        w.queued = False
        pool.depth -= 1

    def _pop(self, pool: _Pool) -> _Waiter | None:
        """The next waiter: the highest band, the tenant whose turn it is, its oldest."""
        for rr in reversed(pool.bands):
            while rr:
                tenant, q = next(iter(rr.items()))
                w = q.popleft()
                if q:
                    rr.move_to_end(tenant)
                else:
                    del rr[tenant]
                pool.depth -= 1
                w.queued = False
                if not w.future.done():  # done: cancelled, its handler has not run yet
                    return w
        return None

    def _admit(self, model: str, pool: _Pool, budget: int) -> int:
        n = 0
        now = self._clock()
        while n < budget:
            w = self._pop(pool)
            if w is None:
                break
            pool.inflight += 1
            w.future.set_result(Ticket(model, w.band, w.tenant, max(0.0, now - w.since)))
            n += 1
        return n

    def _reject(self, model: str, w: _Waiter, reason: str) -> None:
        if w.future.done():  # cancelled, its client gone: not a rejection
            return
        self.rejected[w.band] += 1
        w.future.set_exception(self._error(model, w.band, reason))

    def _error(self, model: str, band: str, reason: str) -> AdmissionRejected:
        ra = self.config.retry_after
        if reason == "timeout":
            why = (
                f"a '{band}' band request waited {self.config.queue_timeout:g}s for model '{model}' "
                "without its turn coming"
            )
        elif reason == "shed":
            why = (
                f"the admission queue of model '{model}' is full and this '{band}' band request "
                "gave way to a higher band"
            )
        else:
            why = (
                f"the admission queue of model '{model}' is full and no waiter is in a lower band "
                f"than this '{band}' band request"
            )
        return AdmissionRejected(
            f"the gateway is overloaded: {why}; retry after {max(1, math.ceil(ra))} seconds, "
            "or send fewer requests at once",
            band=band,
            reason=reason,
            retry_after=ra,
        )

    def _make_room(self, model: str, pool: _Pool, band: str) -> None:
        """The queue is full: shed the lowest band's busiest tenant's newest waiter, or
        refuse the newcomer when nobody waiting is in a lower band than it."""
        lowest = next((i for i, rr in enumerate(pool.bands) if rr), None)
        if lowest is None or _RANK[band] <= lowest:
            self.rejected[band] += 1
            raise self._error(model, band, "queue_full")
        rr = pool.bands[lowest]
        tenant = max(rr, key=lambda t: len(rr[t]))
        victim = rr[tenant][-1]
        self._unlink(pool, victim)
        log.info("admission: %s full; shed a '%s' waiter of %s", model, victim.band, tenant)
        self._reject(model, victim, "shed")

    def _expire(self, model: str, w: _Waiter) -> None:
        pool = self._pools.get(model)
        if pool is None or not w.queued or w.future.done():
            return
        self._unlink(pool, w)
        self._reject(model, w, "timeout")
        self._forget(model, pool)

    def _leave(self, model: str, w: _Waiter) -> None:
        """The waiter's client went away."""
        pool = self._pools.get(model)
        if pool is None:
            return
        if w.queued:
            self._unlink(pool, w)
        elif w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            # Admitted in the same moment it was cancelled: hand the place on.
            self.release(w.future.result())
            return
        self._forget(model, pool)
