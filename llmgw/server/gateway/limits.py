"""The accountant: model allow-lists, budgets, requests and tokens per minute.

Every level that sets a limit is its own pool (see principal.py for the pool
keys); a request is held to all of its principal's pools at once and the
strictest wins. Counters are keyed by pool key, so every principal carrying
the same pool key (the keys of one project, a person's keys) shares them.

A check goes, in this order, and stops at the first refusal:

0. the model allow-list (403);
1. budgets, read only, at every pool with one; a model that costs nothing is
   exempt. A budget stops spending once it is reached rather than refusing the
   request that would cross it: a pool is refused when spent >= budget;
2. requests per minute at every pool with a limit, charging as it goes and
   refunding the pools already charged when a later one refuses;
3. tokens per minute on the request's estimated tokens, likewise; the estimate
   is settled to the real count when the reply ends.

Rate pools are sliding windows of one-second slots: at most the limit in the
last 60 seconds, so 500 requests at once at a key limited to 100 a minute
admit exactly 100 however long they take to arrive. An idle window carries no information and is dropped. Everything here is synchronous and never awaits: on one event loop
a check, a settlement or a cancellation is atomic, so counts are exact under
any concurrency without locks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from llmgw.server.gateway.principal import Pool, Principal

MICROS = 1_000_000
_SWEEP_EVERY = 60.0  # seconds of clock between drops of idle windows and stale spend
_SLOTS = 60  # rate limits are per minute, counted in one-second slots


def utcnow() -> datetime:
    return datetime.now(UTC)


def to_micros(whole_units: float) -> int:
    """A budget or price in whole units, as the integer micro-units it is kept in."""
    return round(whole_units * MICROS)


class LimitError(Exception):
    """A refusal: the HTTP status, a sentence for the client, a code, and headers to send."""

    def __init__(self, status: int, message: str, code: str, retry_after: float | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after
        self.headers = headers if headers is not None else {}


# ----------------------------------------------------------------------- prices


class Pricing:
    """What a model costs, in integer micro-units per 1,000 tokens.

    A model priced at zero is not priced (exempt from budgets), even when a
    fallback price exists; a nonzero fallback price prices every other model.
    """

    __slots__ = ("_table", "_default")

    def __init__(self, table: Mapping[str, tuple[float, float]] | None = None,
                 default: tuple[float, float] | None = None):
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

    def cost_micros(self, model: str, prompt_tokens: int, completion_tokens: int) -> int:
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

    __slots__ = ("cap", "used", "slots", "head")

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

    def idle(self, now: float) -> bool:
        self._advance(int(now))
        return self.used == 0.0


class _Spend:
    """What a pool spent in the current UTC day and month, in micro-units."""

    __slots__ = ("day_key", "day", "month_key", "month")

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


# ------------------------------------------------------------ results and status


@dataclass(slots=True)
class Reservation:
    """What one admitted request holds until it is settled or cancelled."""

    principal: Principal
    model: str
    pools: tuple[Pool, ...]  # every pool of the principal: each is charged its cost at settlement
    estimated_tokens: int
    started_at: float  # the accountant's clock
    done: bool = False
    cost_micros: int = 0
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

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.requests_limit is not None:
            h["x-ratelimit-limit-requests"] = str(self.requests_limit)
            h["x-ratelimit-remaining-requests"] = str(self.requests_remaining)
        if self.tokens_limit is not None:
            h["x-ratelimit-limit-tokens"] = str(self.tokens_limit)
            h["x-ratelimit-remaining-tokens"] = str(self.tokens_remaining)
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


# --------------------------------------------------------------------- accountant


class Accountant:
    """Enforces every pool of a principal; see the module's docstring for the rules."""

    def __init__(self, pricing: Pricing | None = None, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = utcnow):
        self.pricing = pricing if pricing is not None else Pricing()
        self._clock = clock
        self._wall = wall
        self._rpm: dict[str, _Window] = {}
        self._tpm: dict[str, _Window] = {}
        self._spend: dict[str, _Spend] = {}
        self._periods: _Periods | None = None
        self._next_sweep = clock() + _SWEEP_EVERY

    # ------------------------------------------------------------------ check

    def check(self, principal: Principal, model: str, estimated_tokens: int) -> Reservation:
        """Admit one request or raise LimitError. Charges one request and the estimate on every rate pool."""
        allowed = principal.models
        if allowed is not None and model not in allowed:
            may = f"it may use: {', '.join(sorted(allowed))}" if allowed else "it may use no models"
            raise LimitError(403, f"this key may not use {model}; {may}", "model_not_allowed")
        pools = principal.pools
        now = self._clock()
        if now >= self._next_sweep:
            self._sweep(now)

        # 1. budgets: read only, and only for a model that costs something.
        if self.pricing._table or self.pricing._default is not None:
            per = None
            spends = self._spend
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
                assert per is not None
                s = spends.get(pool.key)
                spent = s.spent(pool.period, per.day_key, per.month_key) if s is not None else 0
                if spent >= budget:
                    raise self._budget_refusal(principal, pool, spent, per)

        # 2. requests per minute; 3. tokens per minute on the estimate.
        est = estimated_tokens if estimated_tokens > 0 else 0
        rpm_taken = self._charge(self._rpm, pools, "rpm", 1.0, now, principal, ())
        tpm_taken = self._charge(self._tpm, pools, "tpm", float(est), now, principal, rpm_taken)
        return Reservation(principal, model, pools, est, now, rpm_taken=rpm_taken, tpm_taken=tpm_taken)

    def _charge(self, table: dict[str, _Window], pools: tuple[Pool, ...], kind: str, amount: float, now: float,
                principal: Principal, earlier: list[tuple[_Window, int, float]] | tuple
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
            wait = w.wait_for(now, need)
            if kind == "rpm":
                msg, code = f"the request rate of {describe(pool.key)} is at its limit of {cap} a minute", "rate_limited"
            else:
                msg, code = (f"the token rate of {describe(pool.key)} is at its limit of {cap} a minute "
                             f"(this request needs about {amount:.0f})"), "tokens_limited"
            raise LimitError(429, f"{msg}; retry in {_seconds(wait)}", code, wait,
                             self._refusal_headers(principal, now, wait))
        return taken

    @staticmethod
    def _refund(taken: list[tuple[_Window, int, float]] | tuple, now: float) -> None:
        for w, sec, amount in taken:
            w.adjust(sec, now, -amount)

    def _budget_refusal(self, principal: Principal, pool: Pool, spent: int, per: _Periods) -> LimitError:
        ends = per.ends(pool.period)
        wait = max((ends - self._wall_now()).total_seconds(), 1.0)
        assert pool.budget_micros is not None
        msg = (f"the budget of {describe(pool.key)} is spent for this {pool.period} "
               f"({_money(spent)} of {_money(pool.budget_micros)}); it resets at {ends:%Y-%m-%d %H:%M} UTC")
        return LimitError(429, msg, "budget_spent", wait, self._refusal_headers(principal, self._clock(), wait))

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
        now = self._clock()
        actual = max(prompt_tokens, 0) + max(completion_tokens, 0)
        diff = actual - reservation.estimated_tokens
        if diff:
            for w, sec, _ in reservation.tpm_taken:
                w.adjust(sec, now, float(diff))
        cost = self.pricing.cost_micros(reservation.model, prompt_tokens, completion_tokens)
        if cost:
            per = self._current_periods()
            spends = self._spend
            for pool in reservation.pools:
                s = spends.get(pool.key)
                if s is None:
                    s = spends[pool.key] = _Spend()
                s.add(cost, per.day_key, per.month_key)
        reservation.cost_micros = cost
        return cost

    def cancel(self, reservation: Reservation) -> None:
        """The request never reached an engine: refund its request and its estimated tokens."""
        if reservation.done:
            return
        reservation.done = True
        now = self._clock()
        self._refund(reservation.rpm_taken, now)
        self._refund(reservation.tpm_taken, now)

    # ----------------------------------------------------------------- status

    def status(self, principal: Principal) -> RateStatus:
        """The fullest pool of each kind: the rate pools with the least left, the budget most spent."""
        return self._status(principal, self._clock(), with_budget=True)

    def headers(self, principal: Principal) -> dict[str, str]:
        """x-ratelimit-{limit,remaining}-{requests,tokens} of the fullest pools; a kind no pool limits is left out."""
        return self._headers(principal.pools, self._clock())

    def _headers(self, pools: tuple[Pool, ...], now: float) -> dict[str, str]:
        # The same choice as _status (least left, then the smaller limit), without building a RateStatus.
        r_left = t_left = r_cap = t_cap = 0
        r_found = t_found = False
        rb, tb = self._rpm, self._tpm
        for pool in pools:
            cap = pool.rpm
            if cap is not None:
                b = rb.get(pool.key)
                left = cap if b is None else max(int(b.peek(now)), 0)
                if not r_found or left < r_left or (left == r_left and cap < r_cap):
                    r_found, r_left, r_cap = True, left, cap
            cap = pool.tpm
            if cap is not None:
                b = tb.get(pool.key)
                left = cap if b is None else max(int(b.peek(now)), 0)
                if not t_found or left < t_left or (left == t_left and cap < t_cap):
                    t_found, t_left, t_cap = True, left, cap
        h: dict[str, str] = {}
        if r_found:
            h["x-ratelimit-limit-requests"] = str(r_cap)
            h["x-ratelimit-remaining-requests"] = str(r_left)
        if t_found:
            h["x-ratelimit-limit-tokens"] = str(t_cap)
            h["x-ratelimit-remaining-tokens"] = str(t_left)
        return h

    def _status(self, principal: Principal, now: float, *, with_budget: bool) -> RateStatus:
        r = t = None  # (remaining, limit, key)
        budget = None  # (fraction, spent, budget, pool)
        per = None
        for pool in principal.pools:
            if pool.rpm is not None:
                b = self._rpm.get(pool.key)
                left = max(int(b.peek(now)), 0) if b is not None else pool.rpm
                if r is None or (left, pool.rpm) < (r[0], r[1]):
                    r = (left, pool.rpm, pool.key)
            if pool.tpm is not None:
                b = self._tpm.get(pool.key)
                left = max(int(b.peek(now)), 0) if b is not None else pool.tpm
                if t is None or (left, pool.tpm) < (t[0], t[1]):
                    t = (left, pool.tpm, pool.key)
            if with_budget and pool.budget_micros is not None:
                per = per or self._current_periods()
                s = self._spend.get(pool.key)
                spent = s.spent(pool.period, per.day_key, per.month_key) if s is not None else 0
                frac = spent / pool.budget_micros if pool.budget_micros else math.inf
                if budget is None or frac > budget[0]:
                    budget = (frac, spent, pool.budget_micros, pool)
        return RateStatus(
            requests_limit=r[1] if r else None, requests_remaining=r[0] if r else None,
            requests_pool=r[2] if r else None,
            tokens_limit=t[1] if t else None, tokens_remaining=t[0] if t else None,
            tokens_pool=t[2] if t else None,
            budget_micros=budget[2] if budget else None, spent_micros=budget[1] if budget else None,
            budget_pool=budget[3].key if budget else None, period=budget[3].period if budget else None,
            resets_at=per.ends(budget[3].period) if budget and per else None,
        )

    def spent(self, pool_key: str, period: str = "month") -> int:
        """What a pool spent in the current UTC day or month, in micro-units."""
        s = self._spend.get(pool_key)
        if s is None:
            return 0
        per = self._current_periods()
        return s.spent(period, per.day_key, per.month_key)

    # ---------------------------------------------------------------- restore

    def restore(self, rows: Iterable[tuple[str | None, str | None, str | None, str | None, str | None, int, datetime]]) -> None:
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
            for k in keys:
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
