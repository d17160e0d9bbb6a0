"""Leases: a named claim with an owner and an expiry, mixed into Store. Control-plane
leadership is the lease named "leader". And what the leader shares with standbys: the
endpoints of its ready replicas.

Taking and renewing are one statement: an insert that, when the row exists, updates it
only where the caller already owns it or its expiry has passed, and returns the row only
when it did. Two processes racing can therefore not both get it: the database orders the
two statements, and the second finds a live lease owned by the first.

Expiry is judged by the database's clock alone (its "now" is read inside the statement),
so two control planes whose clocks disagree still agree on when a lease ran out.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .records import utcnow
from .schema import leases, replica_endpoints

# The database's clock, in seconds since the epoch, as each dialect writes it (signin.py reads it too).
DB_NOW = {
    "postgresql": "EXTRACT(EPOCH FROM clock_timestamp())::double precision",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}

_CLAIM = """
INSERT INTO leases (name, owner, holder, expires_at, renewed_at)
VALUES (:name, :owner, :holder, {now} + :ttl, {now})
ON CONFLICT (name) DO UPDATE
   SET owner = excluded.owner, holder = excluded.holder,
       expires_at = excluded.expires_at, renewed_at = excluded.renewed_at
 WHERE leases.owner = excluded.owner OR leases.expires_at <= excluded.renewed_at
RETURNING owner
"""


@dataclass(frozen=True)
class Lease:
    """A lease as the store holds it, with the database's clock at the time it was read."""

    name: str
    owner: str
    holder: str
    expires_at: float
    renewed_at: float
    now: float

    @property
    def live(self) -> bool:
        return self.expires_at > self.now


@dataclass(frozen=True)
class PublishedEndpoint:
    """A ready replica's endpoint as the leader publishes it."""

    replica_id: str
    model: str
    url: str
    engine: str
    api_key: str | None = None


class LeasesMixin:
    _engine: AsyncEngine
    _writer: AsyncEngine

    async def lease_claim(self, name: str, owner: str, holder: str, ttl_s: float) -> bool:
        """Take the lease, or renew it, for ``ttl_s`` from the database's now; True when ``owner``
        holds it afterwards. False when another owner's lease has not expired."""
        async with self._writer.begin() as conn:
            sql = text(_CLAIM.format(now=DB_NOW[conn.dialect.name]))
            got = (await conn.execute(sql, {"name": name, "owner": owner, "holder": holder, "ttl": ttl_s})).first()
        return got is not None and got.owner == owner

    async def lease_release(self, name: str, owner: str) -> bool:
        """Give the lease up at once (a clean stop), only if ``owner`` holds it; True when it did."""
        async with self._writer.begin() as conn:
            done = await conn.execute(delete(leases).where(leases.c.name == name, leases.c.owner == owner))
        return bool(done.rowcount)

    async def endpoints_publish(self, rows: list[PublishedEndpoint], lease: str, owner: str) -> bool:
        """Replace the published endpoints with ``rows``, only while ``owner`` holds ``lease`` (checked
        in the same transaction, so a leader that lost the lease cannot overwrite its successor's)."""
        async with self._writer.begin() as conn:
            current = await _read(conn, lease)
            if current is None or current.owner != owner or not current.live:
                return False
            await conn.execute(delete(replica_endpoints))
            if rows:
                now = utcnow()
                await conn.execute(
                    replica_endpoints.insert(),
                    [
                        {
                            "replica_id": r.replica_id,
                            "model": r.model,
                            "url": r.url,
                            "engine": r.engine,
                            "api_key": r.api_key,
                            "published_at": now,
                        }
                        for r in rows
                    ],
                )
        return True

    async def endpoints_published(self) -> list[PublishedEndpoint]:
        async with self._engine.connect() as conn:
            got = await conn.execute(select(replica_endpoints).order_by(replica_endpoints.c.replica_id))
            return [PublishedEndpoint(r.replica_id, r.model, r.url, r.engine, r.api_key) for r in got]

    async def lease_read(self, name: str) -> Lease | None:
        """The lease and the database's now, or None when nobody has ever held it (or it was released)."""
        async with self._engine.connect() as conn:
            return await _read(conn, name)


async def _read(conn: AsyncConnection, name: str) -> Lease | None:
    now = (await conn.execute(text(f"SELECT {DB_NOW[conn.dialect.name]}"))).scalar_one()
    row = (await conn.execute(select(leases).where(leases.c.name == name))).first()
    if row is None:
        return None
    return Lease(row.name, row.owner, row.holder, float(row.expires_at), float(row.renewed_at), float(now))
