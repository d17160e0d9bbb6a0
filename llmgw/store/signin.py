"""Sign-in attempts, mixed into Store: counted before a password is checked, in the store, so
that every worker and every gateway on one store shares one count.

The rules (what is counted against what, what a right password does) are the pages', in
llmgw/server/pages/signin_limit.py; this module keeps the rows and makes counting atomic:

- An attempt names the things it counts against (keys such as "account:ann@example.com"
  and "address:192.0.2.7"), each with its limit. In one transaction it locks each key's
  ``signin_keys`` row (INSERT ... ON CONFLICT DO UPDATE, which on PostgreSQL holds the row
  until the commit; keys in one sorted order, so two attempts never wait on each other in
  a circle), then counts each key's attempts in the window with later statements, which
  see every attempt committed before the lock was granted. Under every limit, it is
  written (one row per key) and commits; at a limit, nothing is written and the wait is
  returned. SQLite serializes writers (the store's writes begin IMMEDIATE), so the same
  statements are just as atomic there, also between processes on one file.
- The attempt is counted before the caller checks the password, so attempts sent together
  are counted one after another and the password check (argon2, slow on purpose) is never
  between reading a count and writing it: no burst gets more checks than the limit.
- ``withdraw_attempt`` removes an attempt's rows (the caller does it for a right password).
- Rows past the window, and lock rows not used within it, are swept before each count.

Times are the database's clock (read inside the transaction), so gateways whose clocks
disagree still agree on the window.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import Table, delete, func, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .errors import StoreError
from .leases import DB_NOW
from .schema import signin_attempts, signin_keys

MAX_KEY_LEN = 400  # the column's width: "account:" and an email of at most 320 characters fit

_INSERT: dict[str, Callable[[Table], postgresql.Insert | sqlite.Insert]] = {
    "postgresql": postgresql.insert,
    "sqlite": sqlite.insert,
}


@dataclass(frozen=True, slots=True)
class AttemptLimit:
    """One thing an attempt counts against, and how many attempts it may hold in the window."""

    key: str
    limit: int


@dataclass(frozen=True, slots=True)
class CountedAttempt:
    """What counting an attempt decided: ``attempt`` (its id, to withdraw it) when it was
    counted and may go on; otherwise None, and ``wait_s``, the seconds until one more fits."""

    attempt: str | None
    wait_s: float = 0.0

    @property
    def refused(self) -> bool:
        return self.attempt is None


def wait_after(recent: Sequence[float], limit: int, window_s: float, now: float) -> float | None:
    """Seconds until one more attempt fits under ``limit``, given the times of the attempts in
    the window, newest first; None when it fits now. A key at its limit frees a place when
    the oldest of its newest ``limit`` attempts leaves the window."""
    if len(recent) < limit:
        return None
    left = recent[limit - 1] + window_s - now
    return left if left > 0 else None


def _check(limits: Sequence[AttemptLimit], window_s: float) -> list[AttemptLimit]:
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not window_s > 0:
        raise StoreError(f"A sign-in window is a number of seconds above zero, not {window_s!r}.")
    if not limits:
        raise StoreError("A sign-in attempt counts against at least one account or address; none was given.")
    by_key: dict[str, AttemptLimit] = {}
    for lim in limits:
        if not lim.key or len(lim.key) > MAX_KEY_LEN:
            raise StoreError(f"A sign-in key is 1 to {MAX_KEY_LEN} characters, not {len(lim.key)}.")
        if isinstance(lim.limit, bool) or not isinstance(lim.limit, int) or lim.limit < 1:
            raise StoreError(f"The sign-in limit of {lim.key} must be a whole number above zero, not {lim.limit!r}.")
        if lim.key in by_key and by_key[lim.key] != lim:
            raise StoreError(f"{lim.key} was given twice with different limits; give it once.")
        by_key[lim.key] = lim
    # One order for every attempt: two attempts lock their shared keys in the same order.
    return [by_key[k] for k in sorted(by_key)]


async def _now(conn: AsyncConnection) -> float:
    return float((await conn.execute(text(f"SELECT {DB_NOW[conn.dialect.name]}"))).scalar_one())


class SigninMixin:
    _engine: AsyncEngine
    _writer: AsyncEngine

    async def count_attempt(self, limits: Sequence[AttemptLimit], window_s: float) -> CountedAttempt:
        """Count one sign-in attempt against every key of ``limits`` at once, or against none:
        counted (and written) when each key holds fewer than its limit of attempts in the last
        ``window_s`` seconds, refused with the longest wait otherwise. Raises StoreError for
        limits that make no sense, and lets the store's own errors through (it is unreachable:
        nothing was counted, so the caller must not check the password)."""
        ordered = _check(limits, window_s)
        await self._sweep_attempts(window_s)
        async with self._writer.begin() as conn:
            d = conn.dialect.name
            ins = _INSERT[d](signin_keys)
            seen = await _now(conn)
            await conn.execute(
                ins.on_conflict_do_update(index_elements=[signin_keys.c.key], set_={"seen_at": ins.excluded.seen_at}),
                [{"key": lim.key, "seen_at": seen} for lim in ordered],
            )
            # Read after the locks: every attempt committed before them is in the window's count.
            now = await _now(conn)
            waits: list[float] = []
            for lim in ordered:
                q = (
                    select(signin_attempts.c.at)
                    .where(signin_attempts.c.key == lim.key, signin_attempts.c.at > now - window_s)
                    .order_by(signin_attempts.c.at.desc())
                    .limit(lim.limit)
                )
                recent = [float(at) for at in (await conn.execute(q)).scalars()]
                wait = wait_after(recent, lim.limit, window_s, now)
                if wait is not None:
                    waits.append(wait)
            if waits:
                return CountedAttempt(None, max(waits))
            attempt = secrets.token_hex(16)
            await conn.execute(
                signin_attempts.insert(), [{"attempt": attempt, "key": lim.key, "at": now} for lim in ordered]
            )
        return CountedAttempt(attempt)

    async def withdraw_attempt(self, attempt: str) -> None:
        """Take a counted attempt back from every key it counted against (an unknown one is fine)."""
        async with self._writer.begin() as conn:
            await conn.execute(delete(signin_attempts).where(signin_attempts.c.attempt == attempt))

    async def attempts_counted(self, key: str, window_s: float) -> int:
        """How many attempts count against ``key`` in the last ``window_s`` seconds (for tests, reports)."""
        async with self._engine.connect() as conn:
            now = await _now(conn)
            q = select(func.count()).where(signin_attempts.c.key == key, signin_attempts.c.at > now - window_s)
            return int((await conn.execute(q)).scalar_one())

    async def _sweep_attempts(self, window_s: float) -> None:
        # Its own transaction, before the count's: the count's locks are held no longer for it.
        async with self._writer.begin() as conn:
            now = await _now(conn)
            await conn.execute(delete(signin_attempts).where(signin_attempts.c.at <= now - window_s))
            await conn.execute(delete(signin_keys).where(signin_keys.c.seen_at <= now - window_s))
