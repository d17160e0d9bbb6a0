"""Running the Alembic migrations from code, serialized against concurrent openers."""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.util.exc import CommandError
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from .errors import StoreError

# Found beside this file, not through a package import: PyInstaller bundles the folder
# as data under the same relative path and sets __file__ inside its bundle accordingly.
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# Execution option: on SQLite, begin with BEGIN IMMEDIATE (take the write lock up front,
# so the busy timeout applies instead of failing on a read-to-write lock upgrade).
WRITE = "llmgw_write"

# Any fixed bigint; advisory locks are scoped to the database.
_PG_LOCK_ID = 0x6C6C6D67770001


# Alembic keeps its `context` and `op` proxies in module globals, so two migrations
# interleaving on one event loop (SQLAlchemy runs run_sync in greenlets) would use each
# other's. One lock per loop: an asyncio.Lock cannot be shared between loops.
_loop_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


def revisions() -> tuple[str, set[str]]:
    """This llmgw's schema revision (the migrations' head) and every revision it knows."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(MIGRATIONS_DIR))
    head = script.get_current_head()
    assert head is not None  # the migrations are one line of revisions
    return head, {s.revision for s in script.walk_revisions()}


def _in_process_lock() -> asyncio.Lock:
    loop = asyncio.get_running_loop()
    lock = _loop_locks.get(loop)
    if lock is None:
        lock = _loop_locks[loop] = asyncio.Lock()
    return lock


def _alembic_config(connection: Connection) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise StoreError(
            f"The store migrations are missing from {MIGRATIONS_DIR}; the llmgw "
            "installation is incomplete (a frozen build must bundle "
            "llmgw/store/migrations as data). Reinstall llmgw."
        )
    cfg = Config()
    # ConfigParser interpolates %, which a path may contain.
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


def _upgrade(connection: Connection) -> None:
    command.upgrade(_alembic_config(connection), "head")


async def upgrade_to_head(engine: AsyncEngine, shown_address: str) -> None:
    """Bring the database to the newest revision; a no-op when it is there already.

    Everything runs in one transaction that first takes a lock, so a second process
    opening the same fresh database waits, then finds it migrated."""
    async with _in_process_lock(), engine.execution_options(**{WRITE: True}).begin() as conn:
        if conn.dialect.name == "postgresql":
            # Released by the commit; a crashed migrator releases it by disconnecting.
            await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_ID})
        # (On SQLite, WRITE made the BEGIN above an IMMEDIATE one: the lock is taken.)
        try:
            await conn.run_sync(_upgrade)
        except CommandError as e:
            raise StoreError(
                f"The store at {shown_address} could not be migrated ({e}). If a "
                "newer llmgw created it, run that version; downgrades are not "
                "automatic."
            ) from None
