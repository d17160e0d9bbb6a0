"""Databases for the tests that run on both store backends."""

from __future__ import annotations

import asyncio
import secrets

import asyncpg
import pytest

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
PG_SKIP = "no PostgreSQL answered on 127.0.0.1:5432"


async def pg_exec(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url, timeout=3)
    try:
        for s in statements:
            await conn.execute(s)
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def pg_database():
    """A fresh database for the module, dropped afterwards; sync so it needs no loop."""
    try:
        asyncio.run(pg_exec(PG_ADMIN, "SELECT 1"))
    except (TimeoutError, OSError, asyncpg.PostgresError):
        pytest.skip(PG_SKIP)
    name = f"llmgw_test_{secrets.token_hex(6)}"
    asyncio.run(pg_exec(PG_ADMIN, f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        asyncio.run(pg_exec(PG_ADMIN, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", "postgres"])
def address(request, tmp_path):
    """An address of an empty database (never migrated) on each backend."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    url = request.getfixturevalue("pg_database")
    # Emptying the schema is a fresh database for the store, and far cheaper than one.
    asyncio.run(pg_exec(url, "DROP SCHEMA public CASCADE", "CREATE SCHEMA public"))
    return url
