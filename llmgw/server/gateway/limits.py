"""The accountant: model allow-lists, budgets, requests and tokens per minute.

Every level that sets a limit is its own pool (see principal.py for the pool
keys); a request is held to all of its principal's pools at once and the
strictest wins. Counters are keyed by pool key, so every principal carrying
the same pool key (the keys of one project, a person's keys) shares them.

A check goes, in this order, and stops at the first refusal:

0. the model allow-list (403);
1. budgets, at every pool with one; a model that costs nothing is exempt. A
   pool is refused when spent + held >= budget, where held is the estimated
   cost of its requests still in progress; an admitted request adds its own
   estimated cost to every budget pool's held amount, and settlement swaps it
   for the real cost. One request may still cross the budget (the one admitted
   just under it), so a budget is overspent by at most about one request's
   estimate however many arrive together, not by what is in flight;
2. requests per minute at every pool with a limit, charging as it goes and
   refunding the pools already charged when a later one refuses;
3. tokens per minute on the request's estimated tokens, likewise; the estimate
   is settled to the real count when the reply ends.

The budget hold is taken last, once every rate pool has admitted the request,
so a refusal anywhere holds nothing.

Rate pools are sliding windows of one-second slots: at most the limit in the
last 60 seconds, so 500 requests at once at a key limited to 100 a minute
admit exactly 100 however long they take to arrive. An idle window carries no information and is dropped. Everything here is synchronous and never awaits: on one event loop
a check, a settlement or a cancellation is atomic, so counts are exact under
any concurrency without locks.

Several gateways on one store (shared limits, shared_limits.py): every rate window is
then a _Leased one, which admits against the share of its pool this gateway leased from
the store (plus, before its first claim comes back, a credit of one chunk) instead of
the pool's whole limit, and wakes the refill task when its share runs low; the check
itself still never touches the store. A request the share is short for while a refill
is possible is refused with AllowancePending, which the proxy may await (refilled(),
bounded by REFILL_WAIT_S) before it answers 429. Budgets add what the other gateways
spent, folded in by the same task (fold_spend).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from llmgw.errors import LlmgwError
from llmgw.server.gateway.principal import Pool, Principal

MICROS = 1_000_000
_SWEEP_EVERY = 60.0  # seconds of clock between drops of idle windows and stale spend
_SLOTS = 60  # rate limits are per minute, counted in one-second slots
_HELD_RETRY = 1.0  # Retry-After when a budget is only held by requests in progress, not spent
# Shared limits: the longest a request waits for refills of its pools' shares before a 429.
REFILL_WAIT_S = 1.0
_CHUNK_SHARE = 10  # a chunk is a tenth of a pool's limit (at least 1)


def utcnow() -> datetime:
    return datetime.now(UTC)


def to_micros(whole_units: float) -> int:
    """A budget or price in whole units, as the integer micro-units it is kept in."""
    return round(whole_units * MICROS)


class LimitError(LlmgwError):
    """A refusal: the HTTP status, a sentence for the client, a code, and headers to send."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after
        self.headers = headers if headers is not None else {}


class AllowancePending(LimitError):
    """A refusal that a refill may still turn around: a shared pool's share here is short, and the
    store may have more. ``ready`` completes when the next refill round has ended; the proxy may
    wait for it (Accountant.refilled) before it answers with the refusal itself."""

    def __init__(self, refusal: LimitError, ready: asyncio.Future[None]):
        super().__init__(refusal.status, refusal.message, refusal.code, refusal.retry_after, refusal.headers)
        self.ready = ready


class Refills(Protocol):
    """What the accountant needs of the task that leases shares (shared_limits.SharedLimits)."""

    @property
    def reachable(self) -> bool: ...  # the store answered the last round: a refill may come

    def wake(self) -> None: ...  # run a round soon

    def next_round(self) -> asyncio.Future[None]: ...  # completes when a round begun after now has ended


class Accounting(Protocol):
    """What the request path asks of an accountant: the server process's Accountant, or a
    worker's, which asks it (worker_limits.py)."""

    pricing: Pricing

    async def admit(
        self, principal: Principal, model: str | None, estimated_prompt: int, estimated_completion: int = 0
    ) -> Reservation: ...

    def settle(self, reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> int: ...

    def cancel(self, reservation: Reservation) -> None: ...

    def headers(self, principal: Principal) -> dict[str, str]: ...


# ----------------------------------------------------------------------- prices


class Pricing:
    """What a model costs, in integer micro-units per 1,000 tokens.

    A model priced at zero is not priced (exempt from budgets), even when a
    fallback price exists; a nonzero fallback price prices every other model.
    """

    __slots__ = ("_default", "_table")

    def __init__(
        self, table: Mapping[str, tuple[float, float]] | None = None, default: tuple[float, float] | None = None
    ):
        self._table: dict[str, tuple[int, int]] = {
            model: (to_micros(p), to_micros(c)) for model, (p, c) in (table or {}).items()
        }
        d = (to_micros(default[0]), to_micros(default[1])) if default is not None else None
        self._default: tuple[int, int] | None = d if d and (d[0] or d[1]) else None

    @classmethod
    def from_config(cls, auth: Any) -> Pricing:
        """From server.yaml's auth block (pricing, default_price), prices in whole units."""
        table = {m: (p.prompt_per_1k, p.completion_per_1k) for m, p in (auth.pricing or {}).items()}
        d = auth.default_price
        return cls(table, (d.prompt_per_1k, d.completion_per_1k) if d is not None else None)

    def price(self, model: str) -> tuple[int, int] | None:
        """(prompt, completion) micro-units per 1,000 tokens; None where the model costs nothing."""
        p = self._table.get(model)
        if p is None:
            return self._default
        return p if (p[0] or p[1]) else None

    def priced(self, model: str) -> bool:
        return self.price(model) is not None

    def anything_priced(self) -> bool:
        """Whether a budget can bind at all (the quotas page warns when not)."""
        return self._default is not None or any(p or c for p, c in self._table.values())

    def cost_micros(self, model: str | None, prompt_tokens: int, completion_tokens: int) -> int:
        """What tokens of a model cost; a request that called no model (None) costs nothing."""
        if model is None:
            return 0
        p = self.price(model)
        if p is None:
            return 0
        # Integer arithmetic, rounded half up: the same tokens always cost the same.
        return (max(prompt_tokens, 0) * p[0] + max(completion_tokens, 0) * p[1] + 500) // 1000


# --------------------------------------------------------------------- counters


class _Window:
    """What a pool used in the last minute, in one-second slots.

    A sliding window rather than a token bucket: "100 a minute" means at most
    100 counted in the last 60 one-second slots, so 500 requests at once admit
    exactly 100 however long they take to arrive, where a bucket would refill a
    few more on the way. Slots rather than a log of every request: a log held a
    Python object per request for a minute, and at thousands of requests a
    second the garbage collector's passes over them were the gateway's p99.
    A charge is identified by its second, so it can be settled or refunded later.
    """

    __slots__ = ("cap", "head", "slots", "used")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.used = 0.0
        self.slots = [0.0] * _SLOTS
        self.head = -1  # the latest second seen; slots hold seconds head-59 .. head

    def _advance(self, sec: int) -> None:
        head = self.head
        if sec <= head:
            return
        slots = self.slots
        if sec - head >= _SLOTS:
            for i in range(_SLOTS):
                slots[i] = 0.0
            self.used = 0.0
        else:
            for s in range(head + 1, sec + 1):
                i = s % _SLOTS
                if slots[i]:
                    self.used -= slots[i]
                    slots[i] = 0.0
            if self.used < 1e-9:
                self.used = 0.0  # no float drift carried across idle periods
        self.head = sec

    def peek(self, now: float) -> float:
        """What is left now."""
        self._advance(int(now))
        return self.cap - self.used

    def take(self, now: float, amount: float) -> int:
        sec = int(now)
        self._advance(sec)
        self.slots[sec % _SLOTS] += amount
        self.used += amount
        return sec

    def adjust(self, sec: int, now: float, delta: float) -> None:
        """Change what a past charge counts for; one that already left the window no longer counts."""
        self._advance(int(now))
        if sec > self.head - _SLOTS:
            self.slots[sec % _SLOTS] += delta
            self.used += delta
        elif delta > 0:
            self.take(now, delta)  # tokens counted after their request's minute passed

    def wait_for(self, now: float, need: float) -> float:
        """Seconds until `need` fits."""
        self._advance(int(now))
        short = need - (self.cap - self.used)
        for s in range(self.head - _SLOTS + 1, self.head + 1):
            short -= self.slots[s % _SLOTS]
            if short <= 0:
                return max(s + _SLOTS - now, 0.0)
        return float(_SLOTS)

    def reset_in(self, now: float) -> float:
        """Seconds until nothing counted is left: the limit back at its full value.

        The newest slot holding a charge leaves the window last; it is nearly
        always the current second, so this rarely looks at more than one slot.
        """
        self._advance(int(now))
        if self.used <= 0.0:
            return 0.0
        slots = self.slots
        for s in range(self.head, self.head - _SLOTS, -1):
            if slots[s % _SLOTS] > 0.0:
                return max(s + _SLOTS - now, 0.0)
        return 0.0

    def idle(self, now: float) -> bool:
        self._advance(int(now))
        return self.used == 0.0


def chunk_of(limit: int) -> int:
    """The unit of allowance a gateway leases of a shared pool: a tenth of its limit, at least 1."""
    return max(1, limit // _CHUNK_SHARE)


class _Leased(_Window):
    """A window of a shared pool: it counts this gateway's own requests (or tokens) like any window,
    against ``cap`` = the share this gateway holds of the pool plus its credit, not the pool's limit.

    The credit is one chunk, given to a window when it is made (nothing counted here in the last
    minute) and taken away once a claim has been answered: what lets a pool's first request here
    go at once, and what is admitted beyond the limit at most, per gateway (shared_limits.py).
    Only the refill task (shared_limits.py) changes the share, and only it forgets the window.
    """

    __slots__ = ("chunk", "credit", "exhausted_until", "last_use", "limit", "low", "others", "share", "short")

    def __init__(self, limit: int, now: float) -> None:
        chunk = chunk_of(limit)
        super().__init__(chunk)
        self.limit = limit
        self.chunk = chunk
        self.share = 0  # leased from the store; never more than the store has granted
        self.credit = chunk
        self.others = 0  # what the other gateways held when this pool was last claimed
        self.low = float(chunk)  # a refill is asked for when less than this is left (set by the refill task)
        self.short = 0.0  # what the requests refused for want of share asked for since the last round
        self.exhausted_until = 0.0  # the store had no more at the last claim: no waits, no claims until then
        self.last_use = now

    def set_share(self, share: int) -> None:
        self.share = share
        self.cap = share + self.credit

    def end_credit(self) -> None:
        self.credit = 0
        self.cap = self.share

    def relimit(self, limit: int) -> None:
        self.limit = limit
        self.chunk = chunk_of(limit)
        self.low = float(self.chunk)
        if self.credit > self.chunk:
            self.credit = self.chunk
            self.cap = self.share + self.credit

    def room(self, now: float) -> float:
        """What this gateway may still count now."""
        self._advance(int(now))
        return self.cap - self.used

    def peek(self, now: float) -> float:
        """What is left of the pool as far as this gateway knows (for headers and pages)."""
        self._advance(int(now))
        return self.limit - self.used - self.others

    def recent(self, now: float, seconds: int = 2) -> float:
        """What was counted in the last few seconds: how fast this pool is used here."""
        self._advance(int(now))
        head = self.head
        return sum(self.slots[s % _SLOTS] for s in range(head - seconds + 1, head + 1))

    def idle(self, now: float) -> bool:
        return False  # never dropped by the sweep: the refill task returns its share first


class _Spend:
    """What a pool spent in the current UTC day and month, in micro-units."""

    __slots__ = ("day", "day_key", "month", "month_key")

    def __init__(self) -> None:
        self.day_key = self.month_key = -1
        self.day = self.month = 0

    def add(self, cost: int, day_key: int, month_key: int) -> None:
        if self.day_key != day_key:
            self.day_key, self.day = day_key, 0
        if self.month_key != month_key:
            self.month_key, self.month = month_key, 0
        self.day += cost
        self.month += cost

    def spent(self, period: str, day_key: int, month_key: int) -> int:
        if period == "day":
            return self.day if self.day_key == day_key else 0
        return self.month if self.month_key == month_key else 0

    def fold(self, day_key: int, day: int, month_key: int, month: int) -> None:
        """Add spend to one period each (what other gateways spent, which need not be the same in both)."""
        if day:
            if self.day_key != day_key:
                self.day_key, self.day = day_key, 0
            self.day += day
        if month:
            if self.month_key != month_key:
                self.month_key, self.month = month_key, 0
            self.month += month


@dataclass(frozen=True, slots=True)
class _Periods:
    """The current UTC day and month, and when each ends."""

    day_key: int
    month_key: int
    day_starts: datetime
    day_ends: datetime
    month_ends: datetime

    @classmethod
    def at(cls, now: datetime) -> _Periods:
        day = datetime(now.year, now.month, now.day, tzinfo=UTC)
        nxt_month = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
        return cls(_day_key(now), _month_key(now), day, day + timedelta(days=1), nxt_month)

    def ends(self, period: str) -> datetime:
        return self.day_ends if period == "day" else self.month_ends


def _as_utc(at: datetime) -> datetime:
    tz = at.tzinfo
    if tz is UTC:
        return at
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def _day_key(at: datetime) -> int:
    return at.toordinal()


def _month_key(at: datetime) -> int:
    return at.year * 12 + at.month - 1


def spend_pools(
    key_id: str | None, user_id: str | None, project_id: str | None, team_id: str | None, org_id: str | None
) -> list[str]:
    """The pool keys a usage row's cost counts in (Accountant.restore's list)."""
    keys = []
    if key_id:
        keys.append(f"key:{key_id}")
    if user_id:
        keys.append(f"user:{user_id}")
    for scope, ident in (("project", project_id), ("team", team_id), ("org", org_id)):
        if ident:
            keys.append(f"{scope}:{ident}")
            if user_id:
                keys.append(f"{scope}-member:{ident}:{user_id}")
    return keys


def period_keys(at: datetime) -> tuple[int, int]:
    """The UTC (day key, month key) of a moment, as spend is kept by."""
    at = _as_utc(at)
    return _day_key(at), _month_key(at)


# ------------------------------------------------------------ results and status


@dataclass(slots=True)
class Reservation:
    """What one admitted request holds until it is settled or cancelled."""

    principal: Principal
    model: str | None  # None: a request that calls no model (Accountant.check)
    pools: tuple[Pool, ...]  # every pool of the principal: each is charged its cost at settlement
    estimated_tokens: int
    started_at: float  # the accountant's clock
    done: bool = False
    cost_micros: int = 0
    # The estimated cost held against each budget pool until settlement (pool keys).
    held_micros: int = 0
    held_pools: tuple[str, ...] = ()
    # (window, second, amount) of each charge, to settle or refund it.
    rpm_taken: list = field(default_factory=list)
    tpm_taken: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RateStatus:
    """The fullest pool of each kind, for headers and the profile page. None: no pool limits that kind."""

    requests_limit: int | None = None
    requests_remaining: int | None = None
    requests_pool: str | None = None
    tokens_limit: int | None = None
    tokens_remaining: int | None = None
    tokens_pool: str | None = None
    budget_micros: int | None = None
    spent_micros: int | None = None
    budget_pool: str | None = None
    period: str | None = None
    resets_at: datetime | None = None
    held_micros: int | None = None  # of the budget pool: estimated cost of its requests in progress
    requests_reset: float | None = None  # seconds until the requests pool is back to its full limit
    tokens_reset: float | None = None

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.requests_limit is not None:
            h["x-ratelimit-limit-requests"] = str(self.requests_limit)
            h["x-ratelimit-remaining-requests"] = str(self.requests_remaining)
            h["x-ratelimit-reset-requests"] = duration(self.requests_reset or 0.0)
        if self.tokens_limit is not None:
            h["x-ratelimit-limit-tokens"] = str(self.tokens_limit)
            h["x-ratelimit-remaining-tokens"] = str(self.tokens_remaining)
            h["x-ratelimit-reset-tokens"] = duration(self.tokens_reset or 0.0)
        return h


def describe(pool_key: str) -> str:
    """A pool key in words: "project proj-1", "project proj-1 for member usr-2", "key key-3 (cluster default)"."""
    scope, _, ident = pool_key.partition(":")
    if scope.endswith("-member"):
        owner, _, user = ident.rpartition(":")
        return f"{scope[:-7]} {owner} for member {user}"
    if scope == "default":
        return f"key {ident} (cluster default)"
    return f"{scope} {ident}"


def _money(micros: int) -> str:
    if micros % 10_000 == 0:
        return f"{micros / MICROS:.2f}"
    return f"{micros / MICROS:.6f}".rstrip("0")


def _seconds(s: float) -> str:
    return f"{math.ceil(s)} s" if s < 120 else f"{math.ceil(s / 60)} min"


def duration(s: float) -> str:
    """Seconds as OpenAI writes them in x-ratelimit-reset-*: "20ms", "1s", "8.64s", "6m0s" (Go's style).

    Rounded up to the millisecond: a client that waits that long finds the limit full.
    """
    if s <= 0:
        return "0s"
    ms = math.ceil(s * 1000 - 1e-6)  # (less a hair of float error: 8.64 s is 8640 ms, not 8641)
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:g}s"  # at most 5 significant digits: %g writes them exactly
    minutes, ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{ms / 1000:g}s" if hours else f"{minutes}m{ms / 1000:g}s"


# --------------------------------------------------------------------- accountant


class Accountant:
    """Enforces every pool of a principal; see the module's docstring for the rules."""

    def __init__(
        self,
        pricing: Pricing | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = utcnow,
    ):
        self.pricing = pricing if pricing is not None else Pricing()
        self._clock = clock
        self._wall = wall
        self._rpm: dict[str, _Window] = {}
        self._tpm: dict[str, _Window] = {}
        self._spend: dict[str, _Spend] = {}
        # Estimated cost of the requests in progress, by budget pool key; an entry goes when it reaches 0.
        self._held: dict[str, int] = {}
        self._periods: _Periods | None = None
        self._next_sweep = clock() + _SWEEP_EVERY
        # Shared limits (share()): the task leasing shares of the rate pools.
        self.shared: Refills | None = None

    def share(self, refills: Refills) -> None:
        """From now on every rate pool is held to a share leased from the store (shared_limits.py).
        Called once, before the first check."""
        self.shared = refills
        self._charge = self._charge_shared  # type: ignore[method-assign]

    # ------------------------------------------------------------------ check

    @staticmethod
    def allowed(principal: Principal, model: str) -> None:
        """Refuse (403) a model outside the principal's allow-list."""
        allowed = principal.models
        if allowed is not None and model not in allowed:
            may = f"it may use: {', '.join(sorted(allowed))}" if allowed else "it may use no models"
            raise LimitError(403, f"this key may not use {model}; {may}", "model_not_allowed")

    def check(
        self, principal: Principal, model: str | None, estimated_prompt: int, estimated_completion: int = 0
    ) -> Reservation:
        """Admit one request or raise LimitError. Charges one request and the estimated tokens on every
        rate pool, and holds the estimated cost (priced as prompt and completion) on every budget pool.

        model None is a request that calls no model (a note, an MCP call, a stored conversation): it
        counts one request on every rate pool and nothing on the token pools, holds nothing, and is
        refused by a budget only when that budget is spent or held by requests in progress."""
        if model is None:
            return self._check_modelless(principal)
        self.allowed(principal, model)
        pools = principal.pools
        now = self._clock()
        if now >= self._next_sweep:
            self._sweep(now)

        ep = max(estimated_prompt, 0)
        ec = max(estimated_completion, 0)

        # 1. budgets, only for a model that costs something: nothing is held until the rates admit it.
        hold = 0
        hold_keys: list[str] = []
        if self.pricing._table or self.pricing._default is not None:
            per = None
            spends = self._spend
            held = self._held
            price = None
            for pool in pools:
                budget = pool.budget_micros
                if budget is None:
                    continue
                if price is None:
                    price = self.pricing.price(model)
                    if price is None:
                        break  # free: exempt from every budget
                    per = self._current_periods()
                    hold = self.pricing.cost_micros(model, ep, ec)
                assert per is not None
                s = spends.get(pool.key)
                spent = s.spent(pool.period, per.day_key, per.month_key) if s is not None else 0
                other = held.get(pool.key, 0)
                if spent + other >= budget:
                    raise self._budget_refusal(principal, pool, spent, other, per)
                hold_keys.append(pool.key)

        # 2. requests per minute; 3. tokens per minute on the estimate.
        est = ep + ec
        rpm_taken = self._charge(self._rpm, pools, "rpm", 1.0, now, principal, ())
        tpm_taken = self._charge(self._tpm, pools, "tpm", float(est), now, principal, rpm_taken)
        if hold:
            held = self._held
            for k in hold_keys:
                held[k] = held.get(k, 0) + hold
        return Reservation(
            principal,
            model,
            pools,
            est,
            now,
            rpm_taken=rpm_taken,
            tpm_taken=tpm_taken,
            held_micros=hold if hold_keys else 0,
            held_pools=tuple(hold_keys) if hold else (),
        )

    def _check_modelless(self, principal: Principal) -> Reservation:
        pools = principal.pools
        now = self._clock()
        if now >= self._next_sweep:
            self._sweep(now)
        per = None
        for pool in pools:
            budget = pool.budget_micros
            if budget is None:
                continue
            per = per or self._current_periods()
            s = self._spend.get(pool.key)
            spent = s.spent(pool.period, per.day_key, per.month_key) if s is not None else 0
            other = self._held.get(pool.key, 0)
            if spent + other >= budget:
                raise self._budget_refusal(principal, pool, spent, other, per)
        rpm_taken = self._charge(self._rpm, pools, "rpm", 1.0, now, principal, ())
        return Reservation(principal, None, pools, 0, now, rpm_taken=rpm_taken)

    def _charge(
        self,
        table: dict[str, _Window],
        pools: tuple[Pool, ...],
        kind: str,
        amount: float,
        now: float,
        principal: Principal,
        earlier: list[tuple[_Window, int, float]] | tuple,
    ) -> list[tuple[_Window, int, float]]:
        """Charge ``amount`` on every pool limiting ``kind`` (rpm or tpm), or refund what this
        request was charged so far (``earlier`` included) and refuse."""
        taken: list[tuple[_Window, int, float]] = []
        for pool in pools:
            cap = pool.rpm if kind == "rpm" else pool.tpm
            if cap is None:
                continue
            w = table.get(pool.key)
            if w is None:
                w = table[pool.key] = _Window(cap)
            w.cap = cap  # the limit may have changed; what was used still counts
            # An estimate larger than the whole minute's allowance goes when nothing else is counted.
            need = amount if kind == "rpm" or amount < cap else cap
            if w.peek(now) >= need:
                taken.append((w, w.take(now, amount), amount))
                continue
            self._refund(taken, now)
            self._refund(earlier, now)
            raise self._rate_refusal(kind, pool.key, cap, amount, w.wait_for(now, need), principal, now)
        return taken

    def _charge_shared(
        self,
        table: dict[str, _Window],
        pools: tuple[Pool, ...],
        kind: str,
        amount: float,
        now: float,
        principal: Principal,
        earlier: list[tuple[_Window, int, float]] | tuple,
    ) -> list[tuple[_Window, int, float]]:
        """_charge for shared pools: against this gateway's share (and credit), waking the refill
        task when the share runs low; a refusal that a refill may turn around is AllowancePending."""
        shared = self.shared
        assert shared is not None
        taken: list[tuple[_Window, int, float]] = []
        for pool in pools:
            cap = pool.rpm if kind == "rpm" else pool.tpm
            if cap is None:
                continue
            w = table.get(pool.key)
            if not isinstance(w, _Leased):
                w = _Leased(cap, now)
                table[pool.key] = w
            elif w.limit != cap:
                w.relimit(cap)  # the refill task brings the share in line
                shared.wake()
            need = amount if kind == "rpm" or amount < cap else cap
            room = w.room(now)
            w.last_use = now  # in use here, admitted or not
            if room >= need:
                taken.append((w, w.take(now, amount), amount))
                if room - amount < w.low and now >= w.exhausted_until:
                    shared.wake()  # running low: refill before it is needed
                continue
            self._refund(taken, now)
            self._refund(earlier, now)
            refusal = self._rate_refusal(kind, pool.key, cap, amount, w.wait_for(now, need), principal, now)
            if now < w.exhausted_until or not shared.reachable:
                raise refusal  # the store had no more a moment ago, or cannot be asked
            w.short += need
            shared.wake()
            raise AllowancePending(refusal, shared.next_round())
        return taken

    def _rate_refusal(
        self, kind: str, key: str, cap: int, amount: float, wait: float, principal: Principal, now: float
    ) -> LimitError:
        if kind == "rpm":
            msg, code = (f"the request rate of {describe(key)} is at its limit of {cap} a minute", "rate_limited")
        else:
            msg, code = (
                (
                    f"the token rate of {describe(key)} is at its limit of {cap} a minute "
                    f"(this request needs about {amount:.0f})"
                ),
                "tokens_limited",
            )
        return LimitError(
            429, f"{msg}; retry in {_seconds(wait)}", code, wait, self._refusal_headers(principal, now, wait)
        )

    async def refilled(
        self,
        pending: AllowancePending,
        principal: Principal,
        model: str | None,
        estimated_prompt: int,
        estimated_completion: int = 0,
    ) -> Reservation:
        """Shared limits: check again after the refill round ``pending`` waits for, and after the
        next ones while the share stays short, for at most REFILL_WAIT_S in all; then the refusal
        stands. Awaits only the refill task, never the store itself."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REFILL_WAIT_S
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise pending
            await asyncio.wait((pending.ready,), timeout=left)
            try:
                return self.check(principal, model, estimated_prompt, estimated_completion)
            except AllowancePending as again:
                pending = again

    async def admit(
        self, principal: Principal, model: str | None, estimated_prompt: int, estimated_completion: int = 0
    ) -> Reservation:
        """check(), and with shared limits the wait for a refill (refilled()) a short share asks for:
        what the request path calls. A worker's accountant (worker_limits.py) answers the same call by
        asking the server process's accountant."""
        try:
            return self.check(principal, model, estimated_prompt, estimated_completion)
        except AllowancePending as pending:
            return await self.refilled(pending, principal, model, estimated_prompt, estimated_completion)

    @staticmethod
    def _refund(taken: list[tuple[_Window, int, float]] | tuple, now: float) -> None:
        for w, sec, amount in taken:
            w.adjust(sec, now, -amount)

    def _budget_refusal(self, principal: Principal, pool: Pool, spent: int, held: int, per: _Periods) -> LimitError:
        ends = per.ends(pool.period)
        assert pool.budget_micros is not None
        if spent >= pool.budget_micros:
            wait = max((ends - self._wall_now()).total_seconds(), 1.0)
            msg = (
                f"the budget of {describe(pool.key)} is spent for this {pool.period} "
                f"({_money(spent)} of {_money(pool.budget_micros)}); it resets at {ends:%Y-%m-%d %H:%M} UTC"
            )
            return LimitError(429, msg, "budget_spent", wait, self._refusal_headers(principal, self._clock(), wait))
        # Not spent yet, but requests in progress may spend the rest: what they leave unspent
        # comes back when they finish, so retrying soon may succeed.
        wait = _HELD_RETRY
        msg = (
            f"the budget of {describe(pool.key)} for this {pool.period} is taken up by requests in progress "
            f"({_money(spent)} spent and up to {_money(held)} held of {_money(pool.budget_micros)}); "
            f"retry in {_seconds(wait)}, when some have finished"
        )
        return LimitError(429, msg, "budget_held", wait, self._refusal_headers(principal, self._clock(), wait))

    def _refusal_headers(self, principal: Principal, now: float, wait: float) -> dict[str, str]:
        h = self._headers(principal.pools, now)
        h["retry-after"] = str(max(1, math.ceil(wait)))
        return h

    # ------------------------------------------------------------- settlement

    def settle(self, reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> int:
        """The reply ended: charge the token difference (actual - estimate) on every token pool the
        estimate was charged on (a negative one refunds), and add the cost to every pool's spend.
        Returns the cost in micro-units. A second settlement (or one after cancel) does nothing and returns 0."""
        if reservation.done:
            return 0
        reservation.done = True
        self._release(reservation)
        now = self._clock()
        actual = max(prompt_tokens, 0) + max(completion_tokens, 0)
        diff = actual - reservation.estimated_tokens
        if diff:
            for w, sec, _ in reservation.tpm_taken:
                w.adjust(sec, now, float(diff))
        cost = self.pricing.cost_micros(reservation.model, prompt_tokens, completion_tokens)
        if cost:
            self._spend_on(reservation.pools, cost)
        reservation.cost_micros = cost
        return cost

    def cancel(self, reservation: Reservation) -> None:
        """The request never reached an engine: refund its request and its estimated tokens, release its hold."""
        if reservation.done:
            return
        reservation.done = True
        self._release(reservation)
        now = self._clock()
        self._refund(reservation.rpm_taken, now)
        self._refund(reservation.tpm_taken, now)

    def forfeit(self, reservation: Reservation) -> None:
        """A request whose end will never be known (the worker serving it died): the engine may
        have served it, so its estimate stands as its use, as admitting it assumed; its estimated
        cost is spent on every pool it was held on."""
        if reservation.done:
            return
        reservation.done = True
        self._release(reservation)
        cost = reservation.held_micros
        if cost:
            self._spend_on(reservation.pools, cost)
        reservation.cost_micros = cost

    def _spend_on(self, pools: tuple[Pool, ...], cost: int) -> None:
        per = self._current_periods()
        spends = self._spend
        for pool in pools:
            s = spends.get(pool.key)
            if s is None:
                s = spends[pool.key] = _Spend()
            s.add(cost, per.day_key, per.month_key)

    def _release(self, reservation: Reservation) -> None:
        amount = reservation.held_micros
        if not amount:
            return
        held = self._held
        for k in reservation.held_pools:
            left = held.get(k, 0) - amount
            if left > 0:
                held[k] = left
            else:
                held.pop(k, None)  # nothing in progress: no entry kept

    def held(self, pool_key: str) -> int:
        """The estimated cost held on a budget pool by its requests in progress, in micro-units."""
        return self._held.get(pool_key, 0)

    # ----------------------------------------------------------------- status

    def status(self, principal: Principal) -> RateStatus:
        """The fullest pool of each kind: the rate pools with the least left, the budget most spent."""
        return self._status(principal, self._clock(), with_budget=True)

    def headers(self, principal: Principal) -> dict[str, str]:
        """x-ratelimit-{limit,remaining,reset}-{requests,tokens} of the fullest pools; a kind no pool limits
        is left out. reset is the time until that pool is back to its full limit (OpenAI's "resets to its
        initial state"): when the last charge counted in its sliding window leaves it."""
        return self._headers(principal.pools, self._clock())

    def _headers(self, pools: tuple[Pool, ...], now: float) -> dict[str, str]:
        # The same choice as _status (least left, then the smaller limit), without building a RateStatus.
        r_left = t_left = r_cap = t_cap = 0
        r_found = t_found = False
        r_win = t_win = None
        rb, tb = self._rpm, self._tpm
        for pool in pools:
            cap = pool.rpm
            if cap is not None:
                b = rb.get(pool.key)
                left = cap if b is None else max(int(b.peek(now)), 0)
                if not r_found or left < r_left or (left == r_left and cap < r_cap):
                    r_found, r_left, r_cap, r_win = True, left, cap, b
            cap = pool.tpm
            if cap is not None:
                b = tb.get(pool.key)
                left = cap if b is None else max(int(b.peek(now)), 0)
                if not t_found or left < t_left or (left == t_left and cap < t_cap):
                    t_found, t_left, t_cap, t_win = True, left, cap, b
        h: dict[str, str] = {}
        if r_found:
            h["x-ratelimit-limit-requests"] = str(r_cap)
            h["x-ratelimit-remaining-requests"] = str(r_left)
            h["x-ratelimit-reset-requests"] = duration(r_win.reset_in(now)) if r_win is not None else "0s"
        if t_found:
            h["x-ratelimit-limit-tokens"] = str(t_cap)
            h["x-ratelimit-remaining-tokens"] = str(t_left)
            h["x-ratelimit-reset-tokens"] = duration(t_win.reset_in(now)) if t_win is not None else "0s"
        return h

    def _status(self, principal: Principal, now: float, *, with_budget: bool) -> RateStatus:
        r = t = None  # (remaining, limit, key, seconds until full)
        budget = None  # (fraction, spent, budget, pool)
        per = None
        for pool in principal.pools:
            if pool.rpm is not None:
                b = self._rpm.get(pool.key)
                left = max(int(b.peek(now)), 0) if b is not None else pool.rpm
                if r is None or (left, pool.rpm) < (r[0], r[1]):
                    r = (left, pool.rpm, pool.key, b.reset_in(now) if b is not None else 0.0)
            if pool.tpm is not None:
                b = self._tpm.get(pool.key)
                left = max(int(b.peek(now)), 0) if b is not None else pool.tpm
                if t is None or (left, pool.tpm) < (t[0], t[1]):
                    t = (left, pool.tpm, pool.key, b.reset_in(now) if b is not None else 0.0)
            if with_budget and pool.budget_micros is not None:
                per = per or self._current_periods()
                s = self._spend.get(pool.key)
                spent = s.spent(pool.period, per.day_key, per.month_key) if s is not None else 0
                frac = spent / pool.budget_micros if pool.budget_micros else math.inf
                if budget is None or frac > budget[0]:
                    budget = (frac, spent, pool.budget_micros, pool)
        return RateStatus(
            requests_limit=r[1] if r else None,
            requests_remaining=r[0] if r else None,
            requests_pool=r[2] if r else None,
            tokens_limit=t[1] if t else None,
            tokens_remaining=t[0] if t else None,
            tokens_pool=t[2] if t else None,
            budget_micros=budget[2] if budget else None,
            spent_micros=budget[1] if budget else None,
            budget_pool=budget[3].key if budget else None,
            period=budget[3].period if budget else None,
            resets_at=per.ends(budget[3].period) if budget and per else None,
            held_micros=self._held.get(budget[3].key, 0) if budget else None,
            requests_reset=r[3] if r else None,
            tokens_reset=t[3] if t else None,
        )

    def fold_spend(self, pool_key: str, day_key: int, day: int, month_key: int, month: int) -> None:
        """Shared limits: add what other gateways spent on a pool; a period that is not the current one is ignored."""
        per = self._current_periods()
        day = day if day_key == per.day_key else 0
        month = month if month_key == per.month_key else 0
        if not (day or month):
            return
        s = self._spend.get(pool_key)
        if s is None:
            s = self._spend[pool_key] = _Spend()
        s.fold(day_key, day, month_key, month)

    def periods(self) -> tuple[int, int]:
        """The current UTC (day key, month key)."""
        per = self._current_periods()
        return per.day_key, per.month_key

    def spent(self, pool_key: str, period: str = "month") -> int:
        """What a pool spent in the current UTC day or month, in micro-units."""
        s = self._spend.get(pool_key)
        if s is None:
            return 0
        per = self._current_periods()
        return s.spent(period, per.day_key, per.month_key)

    # ---------------------------------------------------------------- restore

    def restore(
        self, rows: Iterable[tuple[str | None, str | None, str | None, str | None, str | None, int, datetime]]
    ) -> None:
        """Fold recorded spend into every pool a row belongs to, so budgets survive a restart.

        Each row is (key_id, user_id, project_id, team_id, org_id, cost_micros, at). Rows of the
        current UTC month count toward monthly budgets, rows of the current UTC day toward daily
        ones; older rows are ignored. Pool keys: key:, user:, project:, team:, org:, and
        project-member:P:U, team-member:T:U, org-member:O:U where the row has a user.
        """
        per = self._current_periods()
        spends = self._spend
        for key_id, user_id, project_id, team_id, org_id, cost, at in rows:
            if not cost:
                continue
            at = _as_utc(at)
            if _month_key(at) != per.month_key:
                continue
            on_day = _day_key(at) == per.day_key
            for k in spend_pools(key_id, user_id, project_id, team_id, org_id):
                s = spends.get(k)
                if s is None:
                    s = spends[k] = _Spend()
                if s.month_key != per.month_key:
                    s.month_key, s.month = per.month_key, 0
                if s.day_key != per.day_key:
                    s.day_key, s.day = per.day_key, 0
                s.month += cost
                if on_day:
                    s.day += cost

    # ------------------------------------------------------------ housekeeping

    def _wall_now(self) -> datetime:
        return _as_utc(self._wall())

    def _current_periods(self) -> _Periods:
        now = self._wall_now()
        per = self._periods
        if per is None or now >= per.day_ends or now < per.day_starts:
            per = self._periods = _Periods.at(now)
        return per

    def _sweep(self, now: float) -> None:
        """Drop idle rate windows (they carry nothing) and spend of past periods."""
        self._next_sweep = now + _SWEEP_EVERY
        for table in (self._rpm, self._tpm):
            idle = [k for k, w in table.items() if w.idle(now)]
            for k in idle:
                del table[k]
        per = self._current_periods()
        stale = [k for k, s in self._spend.items() if s.month_key != per.month_key]
        for k in stale:
            del self._spend[k]

    def counts(self) -> dict[str, int]:
        """How many counters are held, for metrics and tests."""
        return {"rpm": len(self._rpm), "tpm": len(self._tpm), "spend": len(self._spend)}
