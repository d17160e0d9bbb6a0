"""Limits that hold across gateways sharing one store.

Each gateway counts its own requests in its own windows (limits.py), so without this two
gateways would each admit a key's whole limit. With shared limits on, each gateway admits
only against a *share* of every rate pool, leased from the store; the shares of all
gateways never add up to more than the limit. The request path never waits on the store:
one background task, a round at a time, at least every TICK_S and at once when a window
runs low, claims more for a pool running short, returns what a pool does not need,
renews the lease on every share and carries budgets' spend between gateways.

Why the limit holds. A window counts what this gateway admitted in the last 60 s, and
admits only while that count stays within its share. A share is raised only after the
store granted it, under a lock on the pool's row, to at most the limit less what the other
gateways hold (store/allowance.py); it is lowered here *before* the store hears of it, and
never below what the window still counts. So at every moment each gateway's count of the
last minute is at most its share, and the shares of all gateways at most the limit: the
gateways together admit at most the limit in any 60 s. A share stays counted in the store
until 60 s after its lease runs out (store's TAIL_S), so whatever a gateway admitted under
it has left every window by the time another gateway can have it, whether the gateway
stopped (it then keeps only what its window counts, for that minute), crashed, or lost the
store.

The bound: at most one chunk per gateway and pool over the limit in any 60 s, where a
chunk is a tenth of the pool's limit (at least 1). The one exception to "only against a
granted share" is the credit: a window made fresh (nothing counted here in the last
minute) may admit one chunk before its first claim is answered, so that a pool's first
requests on a gateway never wait for the store. The claim that follows asks for what the
window counted and more, and once the store has answered (whatever it granted) the credit
is gone; where the store had less free than the credit used, the excess is the error, at
most one chunk. A window is made fresh only after a minute in which it counted nothing, so
one gateway's credits add at most one chunk to any minute. So N gateways admit at most
limit + N chunks in any 60 s: a limit of 100 a minute on two gateways admits at most 120.
(As on one gateway, and apart from this bound: a reply that uses more tokens than its
estimate is charged its real count when it ends, and a request estimated above a whole
minute's tokens goes alone.)

Claims and returns (plan_window). The room a window wants is two chunks, or what it
admitted in the last two seconds when that is more. When less than half of that is left,
or requests were refused for want of share since the last round, it claims what it
counts, what those requests asked for, and that room, up to the limit. It gives back, never
below what it counts: everything once the pool has been unused here for IDLE_RETURN_S;
down to the room it wants when more than twice that (and a chunk) is spare; down to what is
free when the shares exceed the limit (the limit was lowered). A quiet gateway therefore
holds only what its window counts, which it must hold until that leaves the window.

Waiting. A request whose share here is short is refused with AllowancePending when the
store may have more (it answered the last round, and the last claim of this pool did not
find it exhausted); the proxy waits for the round that claims for it, and the next ones,
for at most limits.REFILL_WAIT_S (one second) in all, then answers 429. A round woken
between ticks only claims and returns, so that a burst waits on as little as can be. A pool
the store had no more for is neither claimed again nor waited for during
EXHAUSTED_RETRY_S: its requests are refused at once, as on one gateway.

Losing the store. Rounds that fail are logged once (and again when the store answers);
the gateway keeps enforcing with the shares it holds, refusing at once what they do not
cover, until its lease runs out: LEASE_S after the start of the last round that renewed it,
less MARGIN_S, by the gateway's own clock (the store's expiry is the database's now inside
that round plus LEASE_S, so it comes later). Then every share here is dropped (logged once)
and the gateway takes a new id, so its old rows are never renewed again; each pool then
admits what its credit allows once its window has counted nothing for a minute: at most one
chunk a minute, the same bound. When the store answers again, pools claim anew.

Budgets. Every gateway writes, per pool, what the usage rows it wrote since it started cost
in the current UTC day and month (table gateway_spend), in the same transaction as those
rows (SpendTally is the usage recorder's sink); every tick it reads the others' rows changed
since its last read (again SPEND_OVERLAP_S back, for transactions still committing) and adds
what each grew by to its pools. At start it reads them before the budgets are restored
from the usage rows, which then hold what those totals held. So a gateway sees another's
spend once that one's usage rows are written (usage.flush_interval) and the next tick has
read them (TICK_S): a budget can be overspent by what the other gateways spend in that time,
plus what they have in progress (their holds stay local), on top of each gateway's own bound
(about one request's estimate; limits.py). A gateway that starts while others serve counts
twice what they write while it restores its budgets (the time of that read). A batch whose
commit was never confirmed and that is then written again by another process (kept in the
usage journal, replayed by the next start) is counted again by the others.

When it is on: auth.shared_limits; null (the default) turns it on when the store is
PostgreSQL, the only store gateways on several machines can share. SQLite is one machine's
file; two servers on one file can share it too, with auth.shared_limits: true. Off, the
accountant is exactly as it is without this module. A server's workers are not gateways here:
they ask its accountant (worker_limits.py), which leases for the whole machine, and they write
their spend under its name (SPENDER/...), which its own reads of the others' spend skip.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.config.server import AuthConfig
from llmgw.server.gateway.limits import Accountant, _Leased, period_keys, spend_pools
from llmgw.store import Store, UsageRow
from llmgw.store.allowance import AllowanceRound, ShareAsk, SpendRow, write_spend

log = logging.getLogger("llmgw.gateway.shared_limits")

TICK_S = 1.0  # a round at least this often: returns, renewals, the others' spend
LEASE_S = 30.0  # a share is renewed every round; a gateway that cannot renew keeps its shares this long
MARGIN_S = 1.5  # the lease ends here this much before the store's expiry (clock rates, scheduling)
IDLE_RETURN_S = 5.0  # a pool unused this long here gives back all its window does not count
EXHAUSTED_RETRY_S = 1.0  # a pool the store had no more for is claimed again after this
SPEND_OVERLAP_S = 10.0  # the others' spend rows are read again this far back: rounds still committing
SWEEP_EVERY_S = 60.0  # rows past their tail, and spend of past months, are removed this often
STOP_WAIT_S = 5.0  # at stop, the store gets this long for the last round


def enabled(setting: bool | None, store: Store) -> bool:
    """auth.shared_limits: true or false as set; null: on for PostgreSQL, off for SQLite."""
    if setting is not None:
        return setting
    return store.engine.dialect.name == "postgresql"


def _new_id() -> str:
    return "gw-" + secrets.token_hex(8)


@dataclass
class _Stats:
    claimed: dict[str, int] = field(default_factory=lambda: {"rpm": 0, "tpm": 0})
    returned: dict[str, int] = field(default_factory=lambda: {"rpm": 0, "tpm": 0})
    claims: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, full | short | none)
    failures: int = 0


@dataclass(slots=True)
class _Planned:
    window: _Leased
    ask: ShareAsk


class _Tally:
    """What one pool's usage rows written by this gateway cost, in the latest UTC day and month seen."""

    __slots__ = ("day", "day_key", "month", "month_key")

    def __init__(self, day_key: int = -1, day: int = 0, month_key: int = -1, month: int = 0) -> None:
        self.day_key, self.day, self.month_key, self.month = day_key, day, month_key, month

    def plus(self, cost: int, day_key: int, month_key: int) -> _Tally:
        t = _Tally(self.day_key, self.day, self.month_key, self.month)
        # A row of an earlier period than the one kept (a journal replayed) counts in neither.
        if day_key > t.day_key:
            t.day_key, t.day = day_key, 0
        if day_key == t.day_key:
            t.day += cost
        if month_key > t.month_key:
            t.month_key, t.month = month_key, 0
        if month_key == t.month_key:
            t.month += cost
        return t


class SpendTally:
    """The usage recorder's sink when limits are shared: it writes a batch of usage rows and, in the
    same transaction, this gateway's new spend totals of every pool the batch touches (what the
    usage rows it wrote since it started cost), for the other gateways to read.

    Being one transaction keeps the totals and the usage rows in step: a gateway that starts reads
    the others' totals, then restores budgets from the usage rows, and whatever a total held then
    is in those rows, so only what the totals grow by later is added to them."""

    def __init__(self, store: Store, spender: str) -> None:
        self.store = store
        self.spender = spender
        self._totals: dict[str, _Tally] = {}
        # One batch at a time: two at once (a flush while the writer writes) would each write
        # the totals before the other's batch, and the later commit would lose the earlier's.
        self._lock = asyncio.Lock()

    async def insert_usage(self, rows: Sequence[UsageRow]) -> None:
        async with self._lock:
            await self._insert(rows)

    async def _insert(self, rows: Sequence[UsageRow]) -> None:
        totals = self._totals
        new: dict[str, _Tally] = {}
        for r in rows:
            cost = r.cost_micros
            if not cost:
                continue
            day_key, month_key = period_keys(r.at)
            for k in spend_pools(r.key_id, r.user_id, r.project_id, r.team_id, r.org_id):
                t = new.get(k) or totals.get(k) or _Tally()
                new[k] = t.plus(cost, day_key, month_key)
        if not new:
            await self.store.insert_usage(rows)
            return
        spend = [SpendRow(self.spender, k, t.day_key, t.day, t.month_key, t.month) for k, t in new.items()]

        async def with_spend(conn: AsyncConnection) -> None:
            await write_spend(conn, spend)

        await self.store.insert_usage(rows, also=with_spend)
        # Only once committed; a batch that failed is written again, with the same totals.
        totals.update(new)

    def sweep(self, month_key: int) -> None:
        for k in [k for k, t in self._totals.items() if t.month_key < month_key]:
            del self._totals[k]


class SharedLimits:
    """The refill task: leases shares of the accountant's rate pools and carries budgets' spend.

    ``reachable``, ``wake()`` and ``next_round()`` are what the accountant calls (limits.Refills);
    everything else runs in the task. Made before the usage recorder (whose sink is ``tally``);
    ``read_baseline()`` before budgets are restored; ``start()`` after.
    """

    def __init__(
        self,
        store: Store,
        *,
        lease_s: float = LEASE_S,
        tick_s: float = TICK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= MARGIN_S:
            raise ValueError(f"the lease must be longer than the margin of {MARGIN_S} s")
        self.store = store
        self.accountant = Accountant()  # until start(): the gateway's own
        self.lease_s = lease_s
        self.tick_s = tick_s
        self._clock = clock
        self.gateway = _new_id()  # in rate_shares: a new one after a lease runs out
        self.spender = self.gateway  # in gateway_spend: for the life of the process
        self.tally = SpendTally(store, self.spender)
        self.reachable = True
        self.stats = _Stats()
        self._wake = asyncio.Event()
        self._next: asyncio.Future[None] | None = None
        self._task: asyncio.Task | None = None
        self._inflight: asyncio.Future[AllowanceRound] | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._epoch = 0  # moves when the lease runs out: a round begun before answers for nobody
        self._spend_since: float | None = None  # None: the next read is the baseline
        self._seen: dict[tuple[str, str], tuple[int, int, int, int]] = {}
        self._next_sweep = clock() + SWEEP_EVERY_S
        self._failing = False
        self._lost = False

    # -- what the accountant calls (synchronous, on the request path) ----------

    def wake(self) -> None:
        if not self._wake.is_set():
            self._wake.set()

    def next_round(self) -> asyncio.Future[None]:
        fut = self._next
        if fut is None:
            fut = self._next = asyncio.get_running_loop().create_future()
        return fut

    # -- life -------------------------------------------------------------------

    async def read_baseline(self) -> None:
        """What the other gateways' spend rows hold now: the usage rows the budgets are restored
        from next hold it already, so only what those rows grow by later is added. A failure is
        logged; the first round that reads them then takes the baseline."""
        try:
            res = await self.store.allowance_round(
                self.gateway, [], self.lease_s, renew=False, spender=self.spender, read_spend=True
            )
        except Exception as exc:
            self._failed(exc)
            return
        self._fold(res)
        self._spend_since = res.now - SPEND_OVERLAP_S

    async def start(self, accountant: Accountant) -> None:
        """Share the accountant's pools from now on, and run the rounds."""
        self.accountant = accountant
        accountant.share(self)
        await self._round()
        self._task = asyncio.create_task(self._run(), name="shared limits")

    async def stop(self) -> None:
        """Keep, in the store, only what each window still counts, with the lease ending now (it
        counts for one more minute). Called after the usage recorder's last flush, which wrote
        this gateway's last spend with its rows."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait((self._inflight,), timeout=STOP_WAIT_S)
        if self._inflight is None or self._inflight.done():
            final = asyncio.ensure_future(self._round(tick=True, final=True))
            await asyncio.wait((final,), timeout=STOP_WAIT_S)
            if not final.done():
                log.warning("shared limits: the store did not take the last round within %g s", STOP_WAIT_S)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def _run(self) -> None:
        next_tick = self._clock() + self.tick_s
        while True:
            left = next_tick - self._clock()
            if left > 0 and not self._wake.is_set():
                try:
                    async with asyncio.timeout(left):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            self._wake.clear()
            # Woken between ticks, a round only claims and returns: the lock on a pool is the
            # one thing a burst waits for, so nothing else rides along.
            tick = self._clock() >= next_tick
            if tick:
                next_tick = self._clock() + self.tick_s
            try:
                await self._round(tick=tick)
            except Exception:
                # A bug, not the store (whose failures _round handles): said, and the rounds go on.
                log.exception("shared limits: a round failed")
            if self._clock() >= self._next_sweep:
                self._next_sweep = self._clock() + SWEEP_EVERY_S
                await self._sweep()

    # -- one round --------------------------------------------------------------

    async def _round(self, *, tick: bool = True, final: bool = False) -> None:
        """One round. A tick (at least every TICK_S) also renews the lease and carries spend."""
        t0 = self._clock()
        epoch = self._epoch
        fut, self._next = self._next, None
        try:
            planned = self._plan(t0, final)
            if not (tick or planned):
                return  # woken, but nothing to claim (the pools are exhausted) or return
            call = self.store.allowance_round(
                self.gateway,
                [p.ask for p in planned],
                0.0 if final else self.lease_s,
                renew=tick,
                spender=self.spender,
                read_spend=tick and not final,
                spend_since=self._spend_since,
            )
            # Shielded: a stop does not push a cancellation into the driver mid-write (see usage.py).
            self._inflight = asyncio.ensure_future(call)
            self._inflight.add_done_callback(_consume)
            try:
                res = await asyncio.shield(self._inflight)
            except Exception as exc:
                self._failed(exc)
                return
            if epoch != self._epoch:
                return  # the lease ran out while the store had this round: its grants are not ours
            self._apply(res, planned, t0, tick and not final)
        finally:
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _plan(self, now: float, final: bool) -> list[_Planned]:
        """What to ask the store for each shared window; returns are applied here, at once."""
        acc = self.accountant
        planned: list[_Planned] = []
        for kind, table in (("rpm", acc._rpm), ("tpm", acc._tpm)):
            for key, w in list(table.items()):
                if not isinstance(w, _Leased):
                    continue
                p = plan_window(w, kind, key, now, final=final)
                if p is None:
                    if not final and w.share == 0 and w.used <= 0 and w.short <= 0:
                        del table[key]  # nothing held, nothing counted: a request makes it fresh
                    continue
                if not p.claim:
                    self.stats.returned[kind] += w.share - p.want
                    w.set_share(p.want)  # lowered before the store hears of it
                planned.append(_Planned(w, p))
        return planned

    def _apply(self, res: AllowanceRound, planned: list[_Planned], t0: float, renewed: bool) -> None:
        if self._failing:
            log.warning("shared limits: the store answers again; pools claim their shares anew")
        self._failing = False
        self._lost = False
        self.reachable = True
        now = self._clock()
        by_pool = {(p.ask.pool_key, p.ask.kind): p for p in planned}
        for g in res.grants:
            p = by_pool.get((g.pool_key, g.kind))
            if p is None or g.others is None:
                continue
            w, ask = p.window, p.ask
            w.others = g.others
            got = g.share - ask.floor
            self.stats.claimed[ask.kind] += max(got, 0)
            result = "full" if g.share >= ask.want else "short" if got > 0 else "none"
            self.stats.claims[(ask.kind, result)] = self.stats.claims.get((ask.kind, result), 0) + 1
            w.end_credit()
            w.set_share(g.share)
            w.short = 0.0
            if g.share < ask.want:
                w.exhausted_until = now + EXHAUSTED_RETRY_S
        if renewed:
            self._fold(res)
            self._spend_since = res.now - SPEND_OVERLAP_S
            self._renewed(t0)

    def _fold(self, res: AllowanceRound) -> None:
        baseline = self._spend_since is None
        acc = self.accountant
        for r in res.spend:
            k = (r.gateway, r.pool_key)
            old = self._seen.get(k)
            self._seen[k] = (r.day_key, r.day_micros, r.month_key, r.month_micros)
            if baseline:
                continue
            day = r.day_micros - (old[1] if old is not None and old[0] == r.day_key else 0)
            month = r.month_micros - (old[3] if old is not None and old[2] == r.month_key else 0)
            if day or month:
                acc.fold_spend(r.pool_key, r.day_key, day, r.month_key, month)

    def _renewed(self, t0: float) -> None:
        """Every share here is ours until t0 + lease - margin by our clock."""
        loop = asyncio.get_running_loop()
        if self._expiry is not None:
            self._expiry.cancel()
        left = t0 + self.lease_s - MARGIN_S - self._clock()
        self._expiry = loop.call_at(loop.time() + max(left, 0.0), self._lease_ran_out)

    def _failed(self, exc: BaseException) -> None:
        self.stats.failures += 1
        self.reachable = False
        if not self._failing:
            self._failing = True
            log.error(
                "shared limits: the store did not answer (%s); enforcing with the shares held here, "
                "for at most %g s, without refills",
                _brief(exc),
                self.lease_s,
            )

    def _lease_ran_out(self) -> None:
        self._expiry = None
        self._epoch += 1
        self.gateway = _new_id()  # the old rows are never renewed again; they expire in the store
        acc = self.accountant
        for table in (acc._rpm, acc._tpm):
            for w in table.values():
                if isinstance(w, _Leased):
                    w.set_share(0)
        if not self._lost:
            self._lost = True
            log.error(
                "shared limits: no round reached the store for %g s, so the shares held here ran out; "
                "each pool admits at most one chunk (a tenth of its limit) a minute here until the store answers",
                self.lease_s - MARGIN_S,
            )

    async def _sweep(self) -> None:
        _day, month = self.accountant.periods()
        try:
            await self.store.allowance_sweep(month)
        except Exception as exc:
            log.debug("shared limits: clean-up failed: %s", _brief(exc))
        for k in [k for k, v in self._seen.items() if v[2] < month]:
            del self._seen[k]
        self.tally.sweep(month)

    # -- metrics ------------------------------------------------------------------

    def held(self) -> dict[str, int]:
        acc = self.accountant
        out = {"rpm": 0, "tpm": 0}
        for kind, table in (("rpm", acc._rpm), ("tpm", acc._tpm)):
            out[kind] = sum(w.share for w in table.values() if isinstance(w, _Leased))
        return out


def plan_window(w: _Leased, kind: str, key: str, now: float, *, final: bool = False) -> ShareAsk | None:
    """The share a window should hold now, as an ask for the store, or None to leave it as it is;
    sets the window's low-water mark.

    The room wanted is two chunks, or the last two seconds' use when more (a burst). A claim when
    less than half of that is left, or requests were refused for want of more since the last
    round: what the window counts, what those requests asked for, and the room wanted, up to the
    limit. A return, never below what the window counts: to what it counts when the pool has been
    unused here for IDLE_RETURN_S; to the room wanted when more than twice that and a chunk is
    spare; to what is free when the shares exceed the limit (it was lowered). At stop: only what
    the window counts."""
    left = w.room(now)  # (brings the window to now)
    used = w.used
    counted = max(math.ceil(used - 1e-6), 0)
    if final:
        want = min(w.share, counted)
        return ShareAsk(key, kind, w.limit, want, want) if want < w.share else None
    chunk = w.chunk
    room = max(2 * chunk, w.recent(now))
    w.low = max(chunk, room / 2)
    if w.short > 0 or left < w.low:
        if now < w.exhausted_until:
            return None
        want = min(math.ceil(used + w.short + room - 1e-6), w.limit)
        return ShareAsk(key, kind, w.limit, want, w.share) if want > w.share else None
    idle = now - w.last_use >= IDLE_RETURN_S
    spare = w.share - used
    want = w.share
    if idle:
        want = counted
    if spare > 2 * room + chunk:
        want = min(want, math.ceil(used + room - 1e-6))
    if w.share > w.limit - w.others:
        want = min(want, max(counted, w.limit - w.others))
    want = max(want, 0)
    return ShareAsk(key, kind, w.limit, want, want) if want < w.share else None


class SharedLimitsCollector:
    """llmgw_shared_limit_* on /metrics."""

    def __init__(self, shared: SharedLimits) -> None:
        self._shared = shared

    def collect(self) -> Iterable[Metric]:
        st = self._shared.stats
        claimed = CounterMetricFamily(
            "llmgw_shared_limit_claimed",
            "Allowance this gateway claimed from the store for shared rate pools (requests or tokens), by kind.",
            labels=["kind"],
        )
        returned = CounterMetricFamily(
            "llmgw_shared_limit_returned",
            "Allowance this gateway gave back to the store, by kind.",
            labels=["kind"],
        )
        for kind in ("rpm", "tpm"):
            claimed.add_metric([kind], st.claimed[kind])
            returned.add_metric([kind], st.returned[kind])
        claims = CounterMetricFamily(
            "llmgw_shared_limit_claims",
            "Claims of allowance by kind and result: full, short (the pool had less free than asked), none.",
            labels=["kind", "result"],
        )
        for (kind, result), n in sorted(st.claims.items()):
            claims.add_metric([kind, result], n)
        failures = CounterMetricFamily(
            "llmgw_shared_limit_store_failures", "Rounds of shared limits the store did not answer."
        )
        failures.add_metric([], st.failures)
        held = GaugeMetricFamily(
            "llmgw_shared_limit_held",
            "Allowance this gateway holds now of shared rate pools, by kind.",
            labels=["kind"],
        )
        for kind, n in self._shared.held().items():
            held.add_metric([kind], n)
        return [claimed, returned, claims, failures, held]


def shared_limits_for(
    auth: AuthConfig, store: Store, registry: CollectorRegistry, *, force: bool = False
) -> SharedLimits | None:
    """Shared limits for a gateway, when auth.shared_limits (or the store's kind) says so, or
    ``force`` (one of several workers: each is a gateway on the store); limits bind keys only,
    so never without auth."""
    if not auth.enabled or not (force or enabled(auth.shared_limits, store)):
        return None
    shared = SharedLimits(store)
    try:
        registry.register(SharedLimitsCollector(shared))
    except ValueError:
        pass  # already registered (a second gateway on the same metrics)
    log.info("shared limits: on; this gateway leases shares of every rate pool from the store as %s", shared.gateway)
    return shared


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().split("\n", 1)[0] or type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "…"
