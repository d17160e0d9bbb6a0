"""Measured capacity in the control plane: what `llmgw ctl bench --save` found one replica of
a model on one profile serves at its latency target, put to use.

The measurements live in the store (store/capacity.py). A control plane reads them at
start, again every ``REREAD_S`` (another control plane on the same store may have saved one,
and a standby that takes over then starts from them) and at once when one is saved through
its own admin API. Each is applied to the endpoints of this control plane's replicas of that
model and profile:

* admission: ``Endpoint.capacity`` is the measured concurrency, so a pool whose requests in
  flight reach the sum of its replicas' capacities reads saturated and further requests wait
  in its queue (gateway/admission.py, ``pool_saturation``);
* routing: ``Endpoint.weight`` is the profile's ``weight`` when it sets one other than the
  default 1, else the measured concurrency, so a replica that carries four times as much is
  sent four times the requests (gateway/routing.py, ``weighted``). A weight in a profile is
  read in the same unit: the concurrency `ctl bench` prints as the weight to put there.

A measurement of 0 (not even one request at a time met the target) is kept and shown, but
gives neither: a limit of 0 would hold every request. A standby's gateway serves the
leader's replicas from the list the leader publishes, which carries no profile, so their
endpoints there keep the defaults until it leads and adopts them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from llmgw.bench import latency_words
from llmgw.config.server import ProfileConfig
from llmgw.store import MeasuredCapacity, Store
from llmgw.timefmt import short_duration

if TYPE_CHECKING:
    from llmgw.server.control.catalog import Catalog
    from llmgw.server.control.reconciler import Replica
    from llmgw.server.gateway.endpoints import Endpoint

log = logging.getLogger("llmgw.control.capacity")

REREAD_S = 30.0
DEFAULT_WEIGHT: float = ProfileConfig.model_fields["weight"].default


def _ago(seconds: float) -> str:
    return short_duration(seconds) + " ago"


class Capacities:
    """The store's measurements, held in memory and applied to replica endpoints."""

    def __init__(self, store: Store, catalog: Catalog, *, interval: float = REREAD_S) -> None:
        self.store = store
        self.catalog = catalog
        self.interval = interval
        self._by: dict[tuple[str, str], MeasuredCapacity] = {}
        # The replicas whose endpoints the measurements apply to: the reconciler's, set once it exists.
        self.replicas: Callable[[], Iterable[Replica]] | None = None
        self._task: asyncio.Task[None] | None = None

    def get(self, model: str, profile: str) -> MeasuredCapacity | None:
        return self._by.get((model, profile))

    async def load(self) -> None:
        """Read every measurement from the store and apply them."""
        self._by = {(c.model, c.profile): c for c in await self.store.capacity_list()}
        self.apply()

    async def save(self, capacity: MeasuredCapacity) -> MeasuredCapacity:
        """Keep a measurement (replacing that of the same model and profile) and apply it now."""
        saved = await self.store.capacity_put(capacity)
        self._by[(saved.model, saved.profile)] = saved
        self.apply()
        return saved

    # -- applying -------------------------------------------------------------------------

    def settings(self, model: str, profile: str) -> tuple[int | None, float]:
        """(capacity, weight) for an endpoint of a replica of ``model`` on ``profile``."""
        m = self._by.get((model, profile))
        capacity = m.concurrent if m is not None and m.concurrent > 0 else None
        entry = self.catalog.get(model)
        prof = next((p for p in entry.model.profiles if p.name == profile), None) if entry is not None else None
        if prof is not None and prof.weight != DEFAULT_WEIGHT:
            return capacity, prof.weight
        return capacity, float(capacity) if capacity is not None else DEFAULT_WEIGHT

    def fit(self, ep: Endpoint, model: str, profile: str) -> None:
        """Give an endpoint its capacity and weight (the reconciler calls it as a replica is published)."""
        ep.capacity, ep.weight = self.settings(model, profile)

    def apply(self) -> None:
        """Fit every published replica endpoint again: a measurement, or a profile's weight, changed."""
        if self.replicas is None:
            return
        for r in self.replicas():
            if r.endpoint is not None:
                self.fit(r.endpoint, r.model, r.profile)

    # -- words ----------------------------------------------------------------------------

    def words(self, model: str, profile: str, *, now: float | None = None) -> str:
        """What explain-placement says about a profile's measured capacity."""
        m = self._by.get((model, profile))
        if m is None:
            return (
                f"capacity not measured; `llmgw ctl bench {model} --target <replica endpoint> --save` "
                "measures what a replica serves"
            )
        now = time.time() if now is None else now
        slo = f"TTFT p99 {latency_words(m.slo_ttft_p99)}, TPOT p99 {latency_words(m.slo_tpot_p99)}"
        when = _ago(now - m.measured_at.timestamp()) + (f" by {m.measured_by}" if m.measured_by else "")
        if m.concurrent <= 0:
            return (
                f"capacity measured {when}: none at the SLO ({slo}): not even one request at a time met it, "
                "so it sets no admission limit or weight"
            )
        capacity, weight = self.settings(model, profile)
        return (
            f"capacity measured {when}: {m.concurrent} concurrent at the SLO ({slo}), "
            f"{m.tokens_per_s:.0f} tok/s; admission counts a replica full at {capacity} in flight, "
            f"routing weight {weight:g}"
        )

    # -- lifetime -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load now (a store that does not answer leaves none, said in the log) and keep re-reading."""
        try:
            await self.load()
        except Exception as exc:  # the store away for a moment: the next read catches up
            log.warning("could not read the measured capacities from the store: %s", exc)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="capacity")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.load()
            except Exception as exc:  # the measurements in memory stay as they were
                log.warning("could not read the measured capacities from the store: %s", exc)
