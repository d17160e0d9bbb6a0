"""Copying a whole store into an empty one (`llmgw keys move-store`), in any direction
between SQLite and PostgreSQL. Keys are stored hashed and cannot be issued again with the
same secret, so moving a store means copying it, row for row.

The source is only read: SQLite is opened read-only (mode=ro, query_only), PostgreSQL in a
read-only transaction, and every table is read in that one transaction, so the copy is the
store as it was at one moment. The destination is migrated to this llmgw's schema, must
then hold no rows, and takes each table in one transaction, in foreign-key order (from the
schema's MetaData), streamed in batches."""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from sqlalchemy import Integer, Table, delete, func, inspect, literal, select, text
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .address import _SCHEME_RE, _read_address_file, resolve_store_address
from .errors import StoreError, mask_password
from .migrate import WRITE, revisions, upgrade_to_head
from .schema import is_derived_table, metadata, store_state
from .store import _create_engine, _shown_address

VERSION_TABLE = "alembic_version"  # Alembic's own; each side's migrations write it
BATCH_ROWS = 2000
# SQLite's WAL index (-shm file): every connection holds a shared lock on this byte (the
# "dead man switch", https://sqlite.org/walformat.html) for as long as it is open.
_SHM_DMS_BYTE = 128
# Linux's struct flock on 64-bit: l_type, l_whence, l_start, l_len, l_pid, padding.
_FLOCK = "hhqqi4x"
_STOP_FIRST = (
    "stop the gateway first (sudo systemctl stop llmgw-server, or end `llmgw server` or `llmgw up`): "
    "rows written while the store is copied would be missing from the copy"
)
_EMPTY_IT = (
    "empty it before running move-store again (for PostgreSQL drop and create the database, for SQLite remove the file)"
)


@dataclass(frozen=True, slots=True)
class CopiedTable:
    name: str
    rows: int


@dataclass(frozen=True, slots=True)
class MoveResult:
    source: str  # as shown in messages: a path, or a URL with the password masked
    destination: str
    tables: tuple[CopiedTable, ...]

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)


def copy_order() -> list[Table]:
    """Every table of the schema, each after the tables its foreign keys refer to."""
    return list(metadata.sorted_tables)


async def move_store(
    source: str,
    destination: str,
    *,
    on_table: Callable[[CopiedTable], None] | None = None,
    batch_rows: int = BATCH_ROWS,
) -> MoveResult:
    """Copy every row of the store at `source` into the empty store at `destination`
    (created and migrated when it has no schema yet). Raises StoreError, having copied
    nothing, when the source is in use, has another schema version than this llmgw, or
    the destination holds rows; a failure while copying empties what was copied again,
    or says which tables to empty when it cannot. `on_table` is called as each table's
    transaction commits."""
    if batch_rows < 1:
        raise StoreError(f"The batch size must be at least 1 row, not {batch_rows}.")
    src_url = _source_url(source)
    dst_url = resolve_store_address(destination)
    src_shown, dst_shown = _shown_address(src_url), _shown_address(dst_url)
    if _same_database(make_url(src_url), make_url(dst_url)):
        raise StoreError(f"--from and --to are the same store ({src_shown}); give the new, empty store as --to.")
    src_engine = _read_only_engine(src_url)
    dst_engine: AsyncEngine | None = None
    try:
        # One connection, and on it one read transaction, from the checks to the last table.
        # What is not a StoreError by now is the source failing: the destination's steps and
        # the copy say what failed themselves.
        async with src_engine.connect() as src:
            await _check_source(src, src_url, src_shown)
            dst_engine = _create_engine(dst_url)
            seeded = await _prepare_destination(dst_engine, dst_shown)
            copied = await _copy_tables(src, dst_engine, src_shown, dst_shown, seeded, batch_rows, on_table)
        return MoveResult(src_shown, dst_shown, tuple(copied))
    except (DBAPIError, OSError) as e:
        raise StoreError(f"Could not read the store at {src_shown}: {_detail(e)}; {_hint(src_engine)}.") from None
    finally:
        await src_engine.dispose()
        if dst_engine is not None:
            await dst_engine.dispose()


# -- addresses -------------------------------------------------------------------------


def _source_url(address: str) -> str:
    """The source's SQLAlchemy URL. A SQLite source must exist: resolving a path would
    create its directory, and copying a store that is not there would copy nothing."""
    given = address.strip() if isinstance(address, str) else address
    if isinstance(given, str) and given.startswith("@"):
        given = _read_address_file(given[1:])
    if isinstance(given, str) and given and not _SCHEME_RE.match(given):
        path = os.path.abspath(os.path.expanduser(given))
        if not os.path.isdir(os.path.dirname(path)):
            raise StoreError(_no_source(path))
    url = resolve_store_address(address)
    u = make_url(url)
    if u.get_backend_name() == "sqlite" and not os.path.isfile(u.database or ""):
        raise StoreError(_no_source(u.database or url))
    return url


def _no_source(path: str) -> str:
    return f"There is no store at {path} to move; give the SQLite file auth.store names (for example /var/lib/llmgw/llmgw.db)."


def _same_database(a: URL, b: URL) -> bool:
    if a.get_backend_name() != b.get_backend_name():
        return False
    if a.get_backend_name() == "sqlite":
        pa, pb = a.database or "", b.database or ""
        if os.path.exists(pa) and os.path.exists(pb):
            return os.path.samefile(pa, pb)
        return os.path.realpath(pa) == os.path.realpath(pb)
    # Different spellings of one server (localhost, 127.0.0.1) get past this; the
    # destination's emptiness check still refuses a populated store copied onto itself.
    return (a.host or "localhost", a.port or 5432, a.database) == (b.host or "localhost", b.port or 5432, b.database)


def _read_only_engine(url: str) -> AsyncEngine:
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        # Repeatable read: every table is read from the same snapshot.
        return _create_engine(url).execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
    # Built as a URL object, not text: the path is a URI here, and parsing it again would
    # undo the escaping of characters like ? and # in file names.
    ro = URL.create("sqlite+aiosqlite", database="file:" + quote(u.database or ""), query={"mode": "ro", "uri": "true"})
    return _create_engine(ro, read_only=True)


# -- the source ------------------------------------------------------------------------


def _layout(conn: Connection) -> dict[str, list[str]]:
    """Tables and their columns, less the derived ones (SQLite's note search), which the
    triggers rebuild on the destination as the notes are copied in."""
    insp = inspect(conn)
    return {t: [c["name"] for c in insp.get_columns(t)] for t in insp.get_table_names() if not is_derived_table(t)}


async def _check_source(src: AsyncConnection, url: str, shown: str) -> None:
    await _refuse_if_in_use(src, url, shown)
    layout = await src.run_sync(_layout)
    version = await src.scalar(text(f"SELECT version_num FROM {VERSION_TABLE}")) if VERSION_TABLE in layout else None
    if version is None:
        raise StoreError(f"{shown} is not an llmgw store (it holds no schema version); check --from.")
    head, known = revisions()
    if version != head:
        if version in known:
            raise StoreError(
                f"The store at {shown} has the schema of an older llmgw ({version}; this llmgw's is {head}). "
                "Migrate it first by opening it once with this llmgw, with the gateway still stopped (any "
                "llmgw keys command does: llmgw keys list --store followed by the address given to --from), "
                "then move it."
            )
        raise StoreError(
            f"The store at {shown} has the schema {version}, which a newer llmgw wrote (this one knows up "
            f"to {head}); run move-store with that llmgw."
        )
    problems = _layout_problems(layout)
    if problems:
        raise StoreError(
            f"The store at {shown} does not have the tables this llmgw's schema describes ({'; '.join(problems)}), "
            "so a copy would leave data behind; nothing was copied."
        )


def _layout_problems(layout: dict[str, list[str]]) -> list[str]:
    """How the tables found differ from the schema module's, which the copy goes by."""
    found = set(layout) - {VERSION_TABLE}
    problems = [f"no table {name}" for name in sorted(set(metadata.tables) - found)]
    problems += [f"a table {name} it does not know" for name in sorted(found - set(metadata.tables))]
    for name in sorted(found & set(metadata.tables)):
        expected = {c.name for c in metadata.tables[name].columns}
        extra, missing = sorted(set(layout[name]) - expected), sorted(expected - set(layout[name]))
        if extra or missing:
            problems.append(
                f"{name} has the columns {', '.join(extra) or '-'} extra and {', '.join(missing) or '-'} missing"
            )
    return problems


async def _refuse_if_in_use(src: AsyncConnection, url: str, shown: str) -> None:
    """Refuse a source another process has open, as far as that can be seen: on
    PostgreSQL, other sessions of the same user on the database (a gateway connects as
    the user its address names; monitoring under other users does not count); on
    SQLite, another process holding the WAL index's lock (a store not in WAL mode, which
    llmgw never makes, cannot be checked)."""
    if src.dialect.name == "postgresql":
        rows = (
            await src.execute(
                text(
                    "SELECT pid, coalesce(client_addr::text, 'a local socket') AS addr, application_name AS app, "
                    "current_user AS me FROM pg_stat_activity WHERE datname = current_database() "
                    "AND usename = current_user AND backend_type = 'client backend' "
                    "AND pid <> pg_backend_pid() ORDER BY pid"
                )
            )
        ).all()
        if rows:
            who = ", ".join(f"pid {r.pid} from {r.addr}" + (f" ({r.app})" if r.app else "") for r in rows[:5])
            more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
            raise StoreError(
                f"The store at {shown} is in use: {len(rows)} other session(s) of {rows[0].me} are connected "
                f"to it ({who}{more}); {_STOP_FIRST}."
            )
        return
    pid = _sqlite_holder(make_url(url).database or "")
    if pid is not None:
        raise StoreError(f"The store at {shown} is open in another process (pid {pid}); {_STOP_FIRST}.")


def _sqlite_holder(path: str) -> int | None:
    """The pid of another process that has the SQLite (WAL) database at `path` open, or
    None. Asks the kernel who holds the WAL index's lock byte (F_GETLK takes no lock, so
    an opening connection is not disturbed); our own process's locks are not reported."""
    if sys.platform != "linux" or struct.calcsize("P") != 8:
        return None  # the flock layout below is Linux's on 64-bit machines
    import fcntl

    try:
        fd = os.open(path + "-shm", os.O_RDONLY)
    except OSError:
        return None  # no WAL index: no connection has it open (the last one removes it)
    try:
        probe = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, _SHM_DMS_BYTE, 1, 0)
        kind, _whence, _start, _len, pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, probe))
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if kind == fcntl.F_UNLCK else int(pid)


# -- the destination -------------------------------------------------------------------


async def _prepare_destination(engine: AsyncEngine, shown: str) -> list[dict[str, Any]]:
    """Migrate the destination and check that it holds no rows. Returns the rows of
    store_state the migrations wrote (its counters), which the source's replace."""
    try:
        async with engine.connect() as conn:
            layout = await conn.run_sync(_layout)
    except (DBAPIError, OSError) as e:
        raise StoreError(f"Could not open the destination store at {shown}: {_detail(e)}; {_hint(engine)}.") from None
    foreign = sorted(set(layout) - set(metadata.tables) - {VERSION_TABLE})
    if foreign:
        raise StoreError(
            f"The destination {shown} holds tables that are not llmgw's ({', '.join(foreign)}); move-store "
            "copies into an empty database or a new file only, so nothing was copied. Give another one "
            "(for PostgreSQL, CREATE DATABASE llmgw)."
        )
    try:
        await upgrade_to_head(engine, shown)
    except (DBAPIError, OSError) as e:
        raise StoreError(f"Could not migrate the destination store at {shown}: {_detail(e)}.") from None
    try:
        async with engine.connect() as conn:
            full: list[str] = []
            for t in copy_order():
                if t is not store_state and await conn.scalar(select(literal(1)).select_from(t).limit(1)) is not None:
                    count = await conn.scalar(select(func.count()).select_from(t))
                    full.append(f"{t.name} ({count:,} {'row' if count == 1 else 'rows'})")
            seeded = [dict(r._mapping) for r in await conn.execute(select(store_state))]
    except DBAPIError as e:
        raise StoreError(f"Could not read the destination store at {shown}: {_detail(e)}.") from None
    if full:
        raise StoreError(
            f"The destination {shown} is not empty: {', '.join(full)}. move-store copies into an empty store "
            f"only, so nothing was copied; give another one, or {_EMPTY_IT}."
        )
    return seeded


# -- copying ---------------------------------------------------------------------------


async def _copy_tables(
    src: AsyncConnection,
    dst_engine: AsyncEngine,
    src_shown: str,
    dst_shown: str,
    seeded: list[dict[str, Any]],
    batch_rows: int,
    on_table: Callable[[CopiedTable], None] | None,
) -> list[CopiedTable]:
    writer = dst_engine.execution_options(**{WRITE: True})
    copied: list[CopiedTable] = []
    done: list[Table] = []
    for table in copy_order():
        try:
            rows = await _copy_table(src, writer, table, batch_rows)
        except Exception as e:
            failed = f"Copying the table {table.name} from {src_shown} to {dst_shown} failed ({_detail(e)})"
            if not done:
                raise StoreError(
                    f"{failed}; it was the first table, so {dst_shown} is empty. {src_shown} was not changed; "
                    "fix the cause and run move-store again."
                ) from e
            names = ", ".join(t.name for t in done)
            try:
                await _undo(writer, done, seeded)
            except Exception as undo_error:
                raise StoreError(
                    f"{failed}; the tables copied before it ({names}) could not be emptied again "
                    f"({_detail(undo_error)}), so {dst_shown} holds part of the store: {_EMPTY_IT}. "
                    f"{src_shown} was not changed."
                ) from e
            raise StoreError(
                f"{failed}; the tables copied before it ({names}) were emptied again, so {dst_shown} is empty. "
                f"{src_shown} was not changed; fix the cause and run move-store again."
            ) from e
        done.append(table)
        copied.append(CopiedTable(table.name, rows))
        if on_table is not None:
            on_table(copied[-1])
    return copied


async def _copy_table(src: AsyncConnection, writer: AsyncEngine, table: Table, batch_rows: int) -> int:
    """One table in one destination transaction, streamed from the source in batches."""
    rows = 0
    async with writer.begin() as dst:
        if table is store_state:
            await dst.execute(delete(store_state))  # the migrations' counters give way to the source's
        query = select(table).order_by(*table.primary_key.columns)
        async with src.stream(query) as result:
            async for batch in result.partitions(batch_rows):
                await dst.execute(table.insert(), [dict(r._mapping) for r in batch])
                rows += len(batch)
        if dst.dialect.name == "postgresql":
            await _advance_sequence(dst, table)
    return rows


async def _advance_sequence(dst: AsyncConnection, table: Table) -> None:
    """Move a serial key's sequence past the ids copied, or the next insert would take id 1
    again and collide."""
    pk = list(table.primary_key.columns)
    if len(pk) != 1 or not isinstance(pk[0].type, Integer):
        return
    col = pk[0]
    name = dst.dialect.identifier_preparer.format_table(table)
    # setval(NULL, …) is NULL: a key without a sequence is left alone. With no rows, the
    # next id stays 1 (is_called false).
    await dst.execute(
        select(
            func.setval(
                func.pg_get_serial_sequence(name, col.name), func.coalesce(func.max(col), 1), func.max(col).is_not(None)
            )
        ).select_from(table)
    )


async def _undo(writer: AsyncEngine, done: Sequence[Table], seeded: list[dict[str, Any]]) -> None:
    """Empty the tables copied so far (children first) and put the migrations' counters back."""
    async with writer.begin() as dst:
        for table in reversed(done):
            await dst.execute(delete(table))
        if store_state in done and seeded:
            await dst.execute(store_state.insert(), seeded)


def _hint(engine: AsyncEngine) -> str:
    if engine.dialect.name == "sqlite":
        return "check that the file is an llmgw store (a SQLite database) and that llmgw may open it"
    return "check that PostgreSQL is running there, that the database exists, and that the user and password are right"


def _detail(e: BaseException) -> str:
    text_ = str(e.orig if isinstance(e, DBAPIError) else e) or type(e).__name__
    return mask_password(text_.strip().splitlines()[0] if text_.strip() else type(e).__name__)
