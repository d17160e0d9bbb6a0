"""Shared limits, mixed into Store: the shares of rate pools that gateways lease, and what
each gateway spent, so that limits hold across every gateway on one store.

The rules (why a pool is never over its limit, what a share means to a gateway) are the
gateway's, in llmgw/server/gateway/shared_limits.py; this module only keeps the rows and
makes a claim atomic:

- ``rate_shares`` holds, per (pool, kind, gateway), the share of the pool's per-minute
  allowance that gateway may admit against, with a lease the gateway renews. A row counts
  while the database's now is before its expiry plus TAIL_S: what a gateway admitted under
  its share stays in the minute's window that long after it last renewed, whether it
  stopped cleanly, crashed or lost the store.
- A claim (a share raised) runs under a lock on the pool's ``rate_pools`` row: one
  statement inserts the row, or updates it where it exists (INSERT ... ON CONFLICT DO
  UPDATE, which on PostgreSQL locks the row until the commit, as SELECT ... FOR UPDATE
  would), and the sum of the other gateways' shares is read by a later statement, so it
  sees every claim committed before the lock was granted. SQLite serializes writers (the
  store's writes begin IMMEDIATE), so the same statements are just as atomic there, also
  between two processes on one file. A share is raised to at most the limit less the
  others' sum, so the shares of live gateways never add up to more than the limit.
- A return (a share lowered) needs no lock: it only gives allowance back.
- ``gateway_spend`` holds, per gateway and pool, what the usage rows that gateway wrote
  since it started cost, as absolute totals for a UTC day and month (so writing it twice is
  harmless), written in the same transaction as those usage rows (write_spend); a gateway
  reads the others' rows changed since its last read.

Expiry is judged by the database's clock alone (read inside the transaction), so gateways
whose clocks disagree still agree on when a share ran out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, bindparam, delete, exists, func, select, text, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .schema import gateway_spend, rate_pools, rate_shares

# A share counts this long after its lease: everything admitted under it has left the
# minute's window by then.
TAIL_S = 60.0

# The database's clock, in seconds since the epoch, as each dialect writes it (as leases.py).
_NOW = {
    "postgresql": "EXTRACT(EPOCH FROM clock_timestamp())::double precision",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
_INSERT: dict[str, Callable[[Table], postgresql.Insert | sqlite.Insert]] = {
    "postgresql": postgresql.insert,
    "sqlite": sqlite.insert,
}

_DROP_SHARE = delete(rate_shares).where(
    rate_shares.c.pool_key == bindparam("p"),
    rate_shares.c.kind == bindparam("k"),
    rate_shares.c.gateway == bindparam("g"),
)


@dataclass(frozen=True, slots=True)
class ShareAsk:
    """A gateway's new share of one pool: ``want``, or as much of it as the pool has free.

    A claim (``want`` above ``floor``) gets min(want, limit - others) but never less than
    ``floor`` (what the gateway holds now); a return (``want`` at most ``floor``) gets ``want``.
    A share of 0 removes the row."""

    pool_key: str
    kind: str  # "rpm" or "tpm"
    limit: int
    want: int
    floor: int

    @property
    def claim(self) -> bool:
        return self.want > self.floor


@dataclass(frozen=True, slots=True)
class ShareGrant:
    """The share a gateway holds after a round, and (for a claim) the others' sum it was judged by."""

    pool_key: str
    kind: str
    share: int
    others: int | None  # None: not read (a return)


@dataclass(frozen=True, slots=True)
class SpendRow:
    """One gateway's spend on one pool since it started, in the UTC day and month of its keys."""

    gateway: str
    pool_key: str
    day_key: int
    day_micros: int
    month_key: int
    month_micros: int


@dataclass(frozen=True, slots=True)
class AllowanceRound:
    """What one round wrote and read: the database's now when it began, the shares as they
    stand after it (of the pools asked about), and the other gateways' spend rows read."""

    now: float
    grants: tuple[ShareGrant, ...]
    spend: tuple[SpendRow, ...]


def share_after(ask: ShareAsk, others: int) -> int:
    """The share a claim gets when the other gateways hold ``others`` of the pool."""
    free = ask.limit - others
    return max(ask.floor, min(ask.want, free), 0)


class AllowanceMixin:
    _engine: AsyncEngine
    _writer: AsyncEngine

    async def allowance_round(
        self,
        gateway: str,
        asks: Sequence[ShareAsk],
        lease_s: float,
        *,
        renew: bool = True,
        spender: str | None = None,
        read_spend: bool = False,
        spend_since: float | None = None,
    ) -> AllowanceRound:
        """One transaction: with ``renew``, renew every share row of ``gateway`` for ``lease_s``
        from the database's now (0: they expire now and count for TAIL_S more); with
        ``read_spend``, read the spend rows of every spender but ``spender`` (``gateway`` when
        not given) and its workers' (``spender``/…) updated at or after ``spend_since`` (None: all of them); then return and
        claim shares, each written with the same expiry. The claims come last, so the pools'
        locks are held for as short a time as can be."""
        spender = gateway if spender is None else spender
        async with self._writer.begin() as conn:
            d = conn.dialect.name
            now = float((await conn.execute(text(f"SELECT {_NOW[d]}"))).scalar_one())
            if renew:
                await conn.execute(
                    update(rate_shares).where(rate_shares.c.gateway == gateway).values(expires_at=now + lease_s)
                )
            read: tuple[SpendRow, ...] = ()
            if read_spend:
                # A server's workers write theirs as SPENDER/…: its accountant counted them already.
                q = select(gateway_spend).where(
                    gateway_spend.c.gateway != spender, ~gateway_spend.c.gateway.startswith(spender + "/")
                )
                if spend_since is not None:
                    q = q.where(gateway_spend.c.updated_at >= spend_since)
                read = tuple(
                    SpendRow(r.gateway, r.pool_key, r.day_key, r.day_micros, r.month_key, r.month_micros)
                    for r in await conn.execute(q)
                )
            grants = await _shares(conn, d, gateway, asks, now, lease_s)
        return AllowanceRound(now, grants, read)

    async def allowance_sweep(self, month_key: int) -> int:
        """Remove share rows past their tail, spend rows of months before ``month_key`` and lock
        rows of pools nobody holds a share of; returns how many share rows went. Any gateway may
        run it: a claim waits for a removal of its pool's row and then inserts it again."""
        async with self._writer.begin() as conn:
            now = float((await conn.execute(text(f"SELECT {_NOW[conn.dialect.name]}"))).scalar_one())
            gone = await conn.execute(delete(rate_shares).where(rate_shares.c.expires_at + TAIL_S <= now))
            await conn.execute(delete(gateway_spend).where(gateway_spend.c.month_key < month_key))
        async with self._writer.begin() as conn:
            held = exists().where(
                rate_shares.c.pool_key == rate_pools.c.pool_key, rate_shares.c.kind == rate_pools.c.kind
            )
            await conn.execute(delete(rate_pools).where(~held))
        return int(gone.rowcount or 0)

    async def rate_shares_held(self, pool_key: str, kind: str) -> dict[str, int]:
        """Gateway -> share of one pool, of the shares that still count (live, or in their tail)."""
        async with self._engine.connect() as conn:
            now = float((await conn.execute(text(f"SELECT {_NOW[conn.dialect.name]}"))).scalar_one())
            q = select(rate_shares.c.gateway, rate_shares.c.share).where(
                rate_shares.c.pool_key == pool_key,
                rate_shares.c.kind == kind,
                rate_shares.c.expires_at + TAIL_S > now,
            )
            return {r.gateway: int(r.share) for r in await conn.execute(q)}


async def write_spend(conn: AsyncConnection, rows: Sequence[SpendRow]) -> None:
    """Write spend rows (each spender's totals, whole) in a transaction of the caller's: the usage
    insert of the rows they count (Store.insert_usage's ``also``), so the two never disagree."""
    if not rows:
        return
    d = conn.dialect.name
    now = float((await conn.execute(text(f"SELECT {_NOW[d]}"))).scalar_one())
    ins = _INSERT[d](gateway_spend)
    await conn.execute(
        ins.on_conflict_do_update(
            index_elements=[gateway_spend.c.gateway, gateway_spend.c.pool_key],
            set_={
                "day_key": ins.excluded.day_key,
                "day_micros": ins.excluded.day_micros,
                "month_key": ins.excluded.month_key,
                "month_micros": ins.excluded.month_micros,
                "updated_at": ins.excluded.updated_at,
            },
        ),
        [
            {
                "gateway": r.gateway,
                "pool_key": r.pool_key,
                "day_key": r.day_key,
                "day_micros": r.day_micros,
                "month_key": r.month_key,
                "month_micros": r.month_micros,
                "updated_at": now,
            }
            for r in sorted(rows, key=lambda r: (r.gateway, r.pool_key))
        ],
    )


async def _shares(
    conn: AsyncConnection, dialect: str, gateway: str, asks: Sequence[ShareAsk], now: float, lease_s: float
) -> tuple[ShareGrant, ...]:
    # Every pool once, in one order, so two gateways' rounds lock pool rows in the same order.
    by_pool: dict[tuple[str, str], ShareAsk] = {}
    for a in asks:
        by_pool[(a.pool_key, a.kind)] = a
    ordered = [by_pool[k] for k in sorted(by_pool)]
    claims = [(a.pool_key, a.kind) for a in ordered if a.claim]
    others: dict[tuple[str, str], int] = {}
    if claims:
        # The lock: inserting the pool's row, or updating it where it exists, holds it until
        # the commit (a no-op update still locks the row), in one statement on both dialects.
        ins = _INSERT[dialect](rate_pools)
        await conn.execute(
            ins.on_conflict_do_update(
                index_elements=[rate_pools.c.pool_key, rate_pools.c.kind], set_={"kind": ins.excluded.kind}
            ),
            [{"pool_key": p, "kind": k} for p, k in claims],
        )
        # A statement after the lock: it sees every claim committed before the lock was had.
        share_in = tuple_(rate_shares.c.pool_key, rate_shares.c.kind).in_(claims)
        q = (
            select(rate_shares.c.pool_key, rate_shares.c.kind, func.sum(rate_shares.c.share).label("held"))
            .where(share_in, rate_shares.c.gateway != gateway, rate_shares.c.expires_at + TAIL_S > now)
            .group_by(rate_shares.c.pool_key, rate_shares.c.kind)
        )
        others = {(r.pool_key, r.kind): int(r.held or 0) for r in await conn.execute(q)}
    grants: list[ShareGrant] = []
    keep: list[dict[str, Any]] = []
    drop: list[dict[str, Any]] = []
    for a in ordered:
        if a.claim:
            held = others.get((a.pool_key, a.kind), 0)
            share = share_after(a, held)
            grants.append(ShareGrant(a.pool_key, a.kind, share, held))
        else:
            share = max(a.want, 0)
            grants.append(ShareGrant(a.pool_key, a.kind, share, None))
        if share > 0:
            keep.append(
                {
                    "pool_key": a.pool_key,
                    "kind": a.kind,
                    "gateway": gateway,
                    "share": share,
                    "expires_at": now + lease_s,
                }
            )
        else:
            drop.append({"p": a.pool_key, "k": a.kind, "g": gateway})
    if keep:
        ins = _INSERT[dialect](rate_shares)
        await conn.execute(
            ins.on_conflict_do_update(
                index_elements=[rate_shares.c.pool_key, rate_shares.c.kind, rate_shares.c.gateway],
                set_={"share": ins.excluded.share, "expires_at": ins.excluded.expires_at},
            ),
            keep,
        )
    if drop:
        await conn.execute(_DROP_SHARE, drop)
    return tuple(grants)
