"""The store's async API: API keys, usage rows, the keys generation counter and the
models added to the catalog at run time. The tenancy tree, people, claims and limits
are in tenancy.py, admin tokens in admin_tokens.py, browser sessions in sessions.py,
sign-in attempts in signin.py, agents' conversations and notes in agents.py and measured
capacity in capacity.py, mixed into Store."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import bindparam, delete, event, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from .address import NUMERIC_PARAMS, resolve_store_address
from .admin_tokens import AdminTokensMixin
from .agents import AgentDataMixin
from .allowance import AllowanceMixin
from .capacity import CapacityMixin
from .errors import AmbiguousKey, KeyAlreadyRevoked, KeyNotFound, StoreError, mask_password
from .keyrows import KEY_COLS as _KEY_COLS
from .keyrows import PREFIX_LEN, SECRET_PREFIX, hash_secret
from .keyrows import check_key_text as _check_text
from .keyrows import key_from_row as _key
from .keyrows import new_secret as _new_secret
from .leases import LeasesMixin
from .migrate import WRITE, upgrade_to_head
from .records import KeyRecord, UsageRow, utcnow
from .reports import ReportsMixin
from .schema import (
    BUMP_GENERATION,
    KEYS_GENERATION,
    UTCDateTime,
    api_keys,
    catalog_models,
    node_marks,
    store_state,
    usage,
)
from .sessions import SessionsMixin
from .signin import SigninMixin
from .tenancy import TenancyMixin

MIN_MATCH_LEN = 6  # shortest leading part of a prefix revoke_key accepts
SQLITE_BUSY_TIMEOUT_S = 15.0

_BUMP_GENERATION = BUMP_GENERATION
_GENERATION = select(store_state.c.value).where(store_state.c.name == KEYS_GENERATION)
_ACTIVE_KEYS = (
    select(api_keys)
    .where(
        api_keys.c.revoked_at.is_(None),
        or_(api_keys.c.expires_at.is_(None), api_keys.c.expires_at > bindparam("now", type_=UTCDateTime())),
    )
    .order_by(api_keys.c.created_at, api_keys.c.id)
)
# Only ever moves last_used_at forward, whatever order batches arrive in.
_TOUCH_KEY = (
    update(api_keys)
    .where(
        api_keys.c.id == bindparam("k_id"),
        or_(api_keys.c.last_used_at.is_(None), api_keys.c.last_used_at < bindparam("k_at", type_=UTCDateTime())),
    )
    .values(last_used_at=bindparam("k_at", type_=UTCDateTime()))
)
# A row whose request_id is already stored is skipped, so a batch written twice (a retry
# after an ambiguous failure, a journal replayed again) is stored once; same on both dialects.
_INSERT_USAGE = {
    "postgresql": postgresql.insert(usage).on_conflict_do_nothing(index_elements=[usage.c.request_id]),
    "sqlite": sqlite.insert(usage).on_conflict_do_nothing(index_elements=[usage.c.request_id]),
}


@dataclass(frozen=True, slots=True)
class CatalogRow:
    """A model added at run time, as stored: its spec is JSON text the catalog validates."""

    name: str
    spec: str
    created_at: datetime
    updated_at: datetime


def _shown_query(text: str) -> str:
    # Someone may paste a whole secret; never echo it into an error or a log.
    if text.startswith(SECRET_PREFIX) and len(text) > PREFIX_LEN:
        return text[:PREFIX_LEN] + "…"
    return text


def _describe_key(k: KeyRecord) -> str:
    state = f", revoked {k.revoked_at.isoformat()}" if k.revoked_at else ""
    return f"{k.id} ({k.name!r}, prefix {k.prefix}{state})"


def _create_engine(url: str | URL, *, read_only: bool = False) -> AsyncEngine:
    """The store's engine. ``read_only`` (move-store's source; for SQLite a ``mode=ro`` URL) takes
    no write lock and refuses writes (PRAGMA query_only) instead of switching the file to WAL."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        # The asyncpg dialect hands query values on as strings; these must be numbers.
        # One value per name: a name given twice comes as a tuple, which float() refuses.
        numbers = {k: float(cast(str, u.query[k])) for k in NUMERIC_PARAMS if k in u.query}
        return create_async_engine(u.difference_update_query(numbers), connect_args=numbers)
    engine = create_async_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
    # WAL lets the server read while the CLI writes; synchronous stays FULL so a committed
    # revocation survives a power cut. A read-only reader changes nothing about the file.
    pragma = "PRAGMA query_only = ON" if read_only else "PRAGMA journal_mode=WAL"

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:  # the DBAPI's own objects: untyped
        # Take BEGIN away from the sqlite3 module (it skips it for SELECT and DDL, so reads would
        # not share one snapshot); _on_begin below emits it.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(pragma)
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE) else "BEGIN")

    return engine


def _shown_address(url: str) -> str:
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return u.database or url
    return mask_password(u.set(drivername="postgresql").render_as_string(hide_password=False))


class Store(
    TenancyMixin,
    AdminTokensMixin,
    SessionsMixin,
    SigninMixin,
    ReportsMixin,
    LeasesMixin,
    AllowanceMixin,
    AgentDataMixin,
    CapacityMixin,
):
    """Open with `await Store.open(address)`; every method is one short transaction."""

    def __init__(self, engine: AsyncEngine, shown_address: str):
        self._engine = engine
        self._writer = engine.execution_options(**{WRITE: True})
        self.address = shown_address  # for messages: a path, or a URL with the password masked

    @classmethod
    async def open(cls, address: str) -> Store:
        url = resolve_store_address(address)
        shown = _shown_address(url)
        engine = _create_engine(url)
        try:
            await upgrade_to_head(engine, shown)
        except StoreError:
            await engine.dispose()
            raise
        except Exception as e:
            await engine.dispose()
            detail = mask_password(str(e.orig if isinstance(e, DBAPIError) else e) or type(e).__name__)
            if engine.dialect.name == "sqlite":
                hint = "check that the file is a SQLite database and that llmgw may write to it"
            else:
                hint = (
                    "check that PostgreSQL is running there, that the database exists, "
                    "and that the user and password are right"
                )
            raise StoreError(
                f"Could not open the store at {shown}: {detail.strip()}. {hint[0].upper()}{hint[1:]}."
            ) from e
        return cls(engine, shown)

    async def close(self) -> None:
        await self._engine.dispose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def engine(self) -> AsyncEngine:
        """For modules that add their own tables and queries to the store."""
        return self._engine

    # -- keys ----------------------------------------------------------------

    async def create_key(
        self, name: str, project: str | None = None, expires_at: datetime | None = None
    ) -> tuple[str, KeyRecord]:
        """Make a key; returns (secret, record). The secret is not kept anywhere."""
        name = _check_text("name", name, required=True)
        project = _check_text("project", project, required=False)
        now = utcnow()
        if expires_at is not None:
            if not isinstance(expires_at, datetime) or expires_at.tzinfo is None:
                raise StoreError(
                    "The key expiry must be a timezone-aware datetime "
                    "(for example datetime.now(timezone.utc) + timedelta(days=30))."
                )
            expires_at = expires_at.astimezone(UTC)
            if expires_at <= now:
                raise StoreError(f"The key expiry {expires_at.isoformat()} is in the past; give a time in the future.")
        secret = _new_secret()
        record = KeyRecord(
            id="key-" + secrets.token_hex(6),
            name=name,
            prefix=secret[:PREFIX_LEN],
            hash=None,
            project=project,
            created_at=now,
            expires_at=expires_at,
        )
        async with self._writer.begin() as conn:
            await conn.execute(
                api_keys.insert().values(
                    id=record.id,
                    name=name,
                    prefix=record.prefix,
                    hash=hash_secret(secret),
                    project=project,
                    created_at=now,
                    expires_at=expires_at,
                )
            )
            await conn.execute(_BUMP_GENERATION)
        return secret, record

    async def list_keys(self, include_revoked: bool = True) -> list[KeyRecord]:
        """All keys, oldest first, without their hashes."""
        q = select(*_KEY_COLS).order_by(api_keys.c.created_at, api_keys.c.id)
        if not include_revoked:
            q = q.where(api_keys.c.revoked_at.is_(None))
        async with self._engine.connect() as conn:
            return [_key(r) for r in await conn.execute(q)]

    async def revoke_key(self, id_or_prefix: str) -> KeyRecord:
        """Revoke by exact id, by the visible prefix or a leading part of it (at least 6
        characters), or by the full secret. Raises KeyNotFound, AmbiguousKey or
        KeyAlreadyRevoked and then changes nothing."""
        query = id_or_prefix.strip() if isinstance(id_or_prefix, str) else ""
        if not query:
            raise KeyNotFound(
                "Give the id of the key to revoke (key-…) or the start of its "
                f"prefix (at least {MIN_MATCH_LEN} characters)."
            )
        cond = api_keys.c.id == query
        if MIN_MATCH_LEN <= len(query) <= PREFIX_LEN:
            # substr, not LIKE: LIKE treats "_" (a secret character) as a wildcard and
            # ignores case on SQLite.
            cond = or_(cond, func.substr(api_keys.c.prefix, 1, len(query)) == query)
        elif len(query) > PREFIX_LEN and query.startswith(SECRET_PREFIX):
            cond = or_(cond, api_keys.c.hash == hash_secret(query))
        shown = _shown_query(query)
        async with self._writer.begin() as conn:
            found = [
                _key(r)
                for r in await conn.execute(
                    select(*_KEY_COLS).where(cond).order_by(api_keys.c.created_at, api_keys.c.id)
                )
            ]
            exact = [k for k in found if k.id == query]
            if exact:
                found = exact
            if not found:
                short = (
                    f" ('{shown}' is shorter than {MIN_MATCH_LEN} characters, so only ids were searched)"
                    if len(query) < MIN_MATCH_LEN
                    else ""
                )
                raise KeyNotFound(
                    f"No API key matches '{shown}'{short}; give its id (key-…) or "
                    f"the start of its prefix (at least {MIN_MATCH_LEN} "
                    "characters), as the key list shows them."
                )
            if len(found) > 1:
                listing = "; ".join(_describe_key(k) for k in found)
                raise AmbiguousKey(
                    f"'{shown}' matches {len(found)} keys: {listing}. Give the id of the one to revoke.", found
                )
            key = found[0]
            if key.revoked_at is None:
                now = utcnow()
                done = await conn.execute(
                    update(api_keys)
                    .where(api_keys.c.id == key.id, api_keys.c.revoked_at.is_(None))
                    .values(revoked_at=now)
                )
                if done.rowcount == 1:
                    await conn.execute(_BUMP_GENERATION)
                    return replace(key, revoked_at=now)
                # Another revoker committed between our read and our update (PostgreSQL).
                key = _key((await conn.execute(select(*_KEY_COLS).where(api_keys.c.id == key.id))).one())
        assert key.revoked_at is not None  # revoked: found so, or by the racing revoker
        raise KeyAlreadyRevoked(
            f"The key {key.id} ({key.name!r}) was already revoked at {key.revoked_at.isoformat()}; nothing changed.",
            key,
        )

    async def active_keys(self) -> list[KeyRecord]:
        """Keys that authenticate now (not revoked, not expired), with their hashes."""
        async with self._engine.connect() as conn:
            return [_key(r, with_hash=True) for r in await conn.execute(_ACTIVE_KEYS, {"now": utcnow()})]

    async def revoked_key_hashes(self) -> list[tuple[str, datetime]]:
        """(hash, revoked_at) of every revoked key, so a server can say "revoked"
        rather than "not valid" to a client still using one."""
        q = select(api_keys.c.hash, api_keys.c.revoked_at).where(api_keys.c.revoked_at.is_not(None))
        async with self._engine.connect() as conn:
            return [(r.hash, r.revoked_at) for r in await conn.execute(q)]

    async def keys_generation(self) -> int:
        """A counter bumped with every key create and revoke: poll it, reload on change."""
        async with self._engine.connect() as conn:
            value = await conn.scalar(_GENERATION)
            assert value is not None  # the first migration inserts the row
            return int(value)

    # -- usage ---------------------------------------------------------------

    async def insert_usage(
        self, rows: Sequence[UsageRow], also: Callable[[AsyncConnection], Awaitable[None]] | None = None
    ) -> None:
        """Insert a batch in one transaction and move each key's last_used_at to the
        batch's latest time for it. Rows whose request_id is already stored are skipped.
        ``also`` runs in the same transaction (shared limits write the batch's spend with it)."""
        if not rows:
            return
        values = [
            {
                "at": r.at,
                "key_id": r.key_id,
                "project": r.project,
                "model": r.model,
                "served_model": r.served_model,
                "endpoint": r.endpoint,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "latency_ms": r.latency_ms,
                "ttft_ms": r.ttft_ms,
                "status": r.status,
                "stream": r.stream,
                "user_id": r.user_id,
                "project_id": r.project_id,
                "team_id": r.team_id,
                "org_id": r.org_id,
                "cost_micros": r.cost_micros,
                "request_id": r.request_id,
            }
            for r in rows
        ]
        latest: dict[str, datetime] = {}
        for r in rows:
            if r.key_id is not None and (r.key_id not in latest or r.at > latest[r.key_id]):
                latest[r.key_id] = r.at
        async with self._writer.begin() as conn:
            await conn.execute(_INSERT_USAGE[conn.dialect.name], values)
            if latest:
                # Sorted, so concurrent batches lock key rows in one order (no deadlock).
                await conn.execute(_TOUCH_KEY, [{"k_id": k, "k_at": latest[k]} for k in sorted(latest)])
            if also is not None:
                await also(conn)

    async def list_usage(self, limit: int = 100, key_id: str | None = None) -> list[UsageRow]:
        """Newest first."""
        if limit < 1:
            raise StoreError(f"The usage limit must be at least 1, not {limit}.")
        q = select(usage).order_by(usage.c.at.desc(), usage.c.id.desc()).limit(limit)
        if key_id is not None:
            q = q.where(usage.c.key_id == key_id)
        async with self._engine.connect() as conn:
            return [UsageRow(**r._mapping) for r in await conn.execute(q)]

    async def count_usage(self) -> int:
        async with self._engine.connect() as conn:
            # COUNT(*) always yields one row.
            return int(cast(int, await conn.scalar(select(func.count()).select_from(usage))))

    # -- catalog -------------------------------------------------------------

    async def catalog_list(self) -> list[CatalogRow]:
        """Models added at run time, by name."""
        async with self._engine.connect() as conn:
            return [
                CatalogRow(**r._mapping)
                for r in await conn.execute(select(catalog_models).order_by(catalog_models.c.name))
            ]

    async def catalog_put(self, name: str, spec_json: str) -> CatalogRow:
        """Insert or replace a model's spec; a replace keeps created_at. The caller
        validates the spec: the store only keeps it."""
        if not isinstance(name, str) or not name or len(name) > 200:
            raise StoreError(f"A catalog model name must be 1 to 200 characters, not {name!r}.")
        if not isinstance(spec_json, str) or not spec_json:
            raise StoreError(f"The catalog spec of {name} must be JSON text.")
        now = utcnow()
        async with self._writer.begin() as conn:
            # One statement on both backends, so two control planes racing cannot both insert.
            ins = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(catalog_models)
            await conn.execute(
                ins.values(name=name, spec=spec_json, created_at=now, updated_at=now).on_conflict_do_update(
                    index_elements=[catalog_models.c.name], set_={"spec": spec_json, "updated_at": now}
                )
            )
            row = (await conn.execute(select(catalog_models).where(catalog_models.c.name == name))).one()
        return CatalogRow(**row._mapping)

    async def catalog_delete(self, name: str) -> bool:
        """Forget a model added at run time; False when there was none by that name."""
        async with self._writer.begin() as conn:
            done = await conn.execute(delete(catalog_models).where(catalog_models.c.name == name))
        return done.rowcount == 1

    # -- node marks ---------------------------------------------------------

    async def node_marks_list(self) -> dict[str, str]:
        """Node id -> "cordoned" or "draining"."""
        async with self._engine.connect() as conn:
            return {r.node_id: r.mark for r in await conn.execute(select(node_marks))}

    async def node_mark_set(self, node_id: str, mark: str | None) -> None:
        """Cordon or drain a node (mark), or clear its mark (None)."""
        if mark not in (None, "cordoned", "draining"):
            raise StoreError(f'A node mark is "cordoned" or "draining", not {mark!r}.')
        if not isinstance(node_id, str) or not node_id or len(node_id) > 200:
            raise StoreError(f"A node id must be 1 to 200 characters, not {node_id!r}.")
        async with self._writer.begin() as conn:
            await conn.execute(delete(node_marks).where(node_marks.c.node_id == node_id))
            if mark is not None:
                await conn.execute(node_marks.insert().values(node_id=node_id, mark=mark, updated_at=utcnow()))
