"""`llmgw keys move-store`: a whole store copied into an empty one, SQLite to SQLite and
SQLite to the real PostgreSQL on 127.0.0.1:5432 (a throwaway database) and back."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import func, inspect, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from llmgw.server.gateway.auth import AuthError, KeyCache
from llmgw.store import MeasuredCapacity, Store, StoreError, UsageRow, resolve_store_address
from llmgw.store.migrate import revisions
from llmgw.store.move import CopiedTable, copy_order, move_store
from llmgw.store.schema import is_derived_table, limit_changes, metadata, store_state, usage
from llmgw.testing.waiting import async_until
from tests.unit.conftest import pg_exec

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "correct horse battery"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"  # as conftest's pg_database makes databases


@pytest.fixture
def pg(pg_database):
    """The module's throwaway PostgreSQL database, emptied (no schema) for this test."""
    asyncio.run(pg_exec(pg_database, "DROP SCHEMA public CASCADE", "CREATE SCHEMA public"))
    return pg_database


@pytest.fixture(params=["sqlite", "postgres"])
def destination(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "moved.db")
    return request.getfixturevalue("pg")


@dataclass
class Populated:
    """Secrets and ids a populated store was given, to check them after the move."""

    project_key: str
    personal_key: str
    revoked_key: str
    claim_token: str
    session_token: str
    admin_token: str
    admin_email: str


async def _populate(address: str) -> Populated:
    """A store as a gateway leaves it, made through the Store's own methods: a tree, people
    (active, manager, pending), keys of every kind, limits and budgets at several levels,
    claims (one used), a session, an admin token, usage with cost, catalog and node marks,
    conversations, stored responses and notes, a measured capacity."""
    async with await Store.open(address) as s:
        await s.add("org", "Acme")
        await s.add("team", "platform", "Acme")
        await s.add("project", "gateway", "Acme/platform")
        await s.add("project", "search", "Acme/platform")
        admin = await s.create_user("root@example.com", PASSWORD, name="Root", admin=True)
        ann = await s.create_user("ann@example.com", PASSWORD, name="Ann")
        await s.sign_up("waiting@example.com", PASSWORD)
        await s.join(ann.id, "project", "Acme/platform/gateway")
        await s.join(admin.id, "org", "Acme", role="manager")
        project_key = await s.issue_key("ci", project="Acme/platform/gateway", band="high")
        personal = await s.issue_key("laptop", owner=ann.email)
        expiring = await s.issue_key(
            "temp", project="Acme/platform/search", expires_at=datetime.now(UTC) + timedelta(days=3)
        )
        revoked = await s.issue_key("old", project="Acme/platform/search")
        await s.revoke_key(revoked.key.id)
        claimed = await s.issue_key("claimed", project="Acme/platform/gateway", owner=ann.email, claim=True)
        assert claimed.claim_token is not None
        await s.claim_key(claimed.claim_token)  # used: its sealed secret is emptied
        waiting = await s.issue_key("unclaimed", project="Acme/platform/gateway", claim=True)
        assert waiting.claim_token is not None
        await s.set_limits("project", "Acme/platform/gateway", budget_micros=25_000_000, rpm=100)
        await s.set_limits("project", "Acme/platform/gateway", per_member=True, tpm=5_000)
        await s.set_limits("team", "Acme/platform", band="low", models=["tiny", "small"])
        await s.set_limits("user", ann.email, budget_micros=3_000_000, period="day")
        await s.set_limits("key", project_key.key.id, rpm=7)
        await s.set_limits("org", "Acme", tpm=1_000_000, changed_by=admin.email)
        session_token, _ = await s.create_session(ann.id, 3600)
        admin_token, _ = await s.create_admin_token("ops")
        await s.catalog_put("tiny", '{"name": "tiny", "source": "hf:x/y"}')
        await s.node_mark_set("gpu01", "cordoned")
        await s.capacity_put(
            MeasuredCapacity(
                "tiny",
                "llamacpp-cpu",
                4,
                120.0,
                0.3,
                0.02,
                1,
                None,
                2.0,
                0.1,
                "http://10.0.0.5:20001",
                datetime.now(UTC),
                "token a",
            )
        )
        # Conversations, a response chain and notes (SQLite's search index is rebuilt, not copied).
        gateway_id = project_key.key.project_id
        await s.set_retention("Acme/platform/gateway", "threads", 72)
        await s.append_thread(gateway_id, "t-1", [{"role": "user", "content": "hi"}], "tiny")
        await s.append_thread(None, "t-1", [{"role": "user", "content": "pool"}], "tiny")
        await s.store_response(gateway_id, "resp-1", None, [{"role": "user", "content": "one"}])
        await s.store_response(gateway_id, "resp-2", "resp-1", [{"role": "user", "content": "two"}])
        await s.create_note(gateway_id, "the runbook is in the wiki", title="Runbook")
        now = datetime.now(UTC)
        rows = []
        for i in range(23):  # more than a batch in the tests below, and not a multiple of it
            key = (project_key, personal, expiring)[i % 3]
            rows.append(
                UsageRow(
                    model="tiny",
                    served_model="tiny-q4",
                    endpoint="/v1/chat/completions",
                    status=200 if i % 5 else 429,
                    latency_ms=12.25 + i,
                    ttft_ms=None if i % 2 else 3.5,
                    stream=bool(i % 2),
                    prompt_tokens=10 * i,
                    completion_tokens=i,
                    at=now - timedelta(minutes=i),
                    key_id=key.key.id,
                    project=key.project_path,
                    user_id=key.key.user_id,
                    project_id=key.key.project_id,
                    cost_micros=1_000 * i,
                    request_id=f"req-{i:04d}",
                )
            )
        # A chat-page row: a session's spend, with no key row behind it.
        rows.append(
            UsageRow(
                model="tiny",
                endpoint="/v1/chat/completions",
                status=200,
                latency_ms=5.0,
                key_id=f"session:{ann.id}",
                user_id=ann.id,
                cost_micros=777,
                request_id="req-chat",
            )
        )
        await s.insert_usage(rows)
        # A key made before there was a tree (a label for a project).
        await s.create_key("legacy", project="label")
    return Populated(
        project_key=project_key.secret,
        personal_key=personal.secret,
        revoked_key=revoked.secret,
        claim_token=waiting.claim_token,
        session_token=session_token,
        admin_token=admin_token,
        admin_email=admin.email,
    )


async def _all_rows(address: str) -> dict[str, list[tuple]]:
    """Every table, every row, ordered by primary key; read without migrating anything."""
    engine = create_async_engine(resolve_store_address(address))
    try:
        async with engine.connect() as conn:
            out = {
                t.name: [tuple(r) for r in await conn.execute(select(t).order_by(*t.primary_key.columns))]
                for t in copy_order()
            }
            out["alembic_version"] = [tuple(r) for r in await conn.execute(text("SELECT * FROM alembic_version"))]
            return out
    finally:
        await engine.dispose()


async def _principals(store: Store, secrets: list[str]):
    """What the gateway makes of each secret: its principal (pools, band, models) or its refusal."""
    cache = KeyCache(store)
    await cache.load()
    out = []
    for secret in secrets:
        try:
            out.append(cache.authenticate(f"Bearer {secret}"))
        except AuthError as e:
            out.append(("refused", e.code))
    return out


async def _budgets(store: Store):
    month = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return sorted(await store.usage_cost_since(month - timedelta(days=40)), key=repr)


async def _sessions_on(url: str) -> int:
    """Sessions connected to the database at url, asked from the admin database."""
    conn = await asyncpg.connect(PG_ADMIN, timeout=3)
    try:
        return await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = $1", make_url(url).database)
    finally:
        await conn.close()


async def _no_sessions_on(url: str) -> None:
    # A closed connection's backend leaves pg_stat_activity a moment after the client is done.
    async def gone() -> bool:
        return await _sessions_on(url) == 0

    await async_until(gone, what=f"no sessions left on {url}")


# -- the move -------------------------------------------------------------------------


async def test_a_populated_store_moved_has_every_row_equal_and_its_keys_budgets_and_sessions_still_work(
    tmp_path, destination
):
    source = str(tmp_path / "llmgw.db")
    made = await _populate(source)
    before = Path(source).read_bytes()
    seen: list[CopiedTable] = []

    result = await move_store(source, destination, on_table=seen.append, batch_rows=5)

    assert Path(source).read_bytes() == before  # the source was only read
    src_rows, dst_rows = await _all_rows(source), await _all_rows(destination)
    assert set(src_rows) == set(metadata.tables) | {"alembic_version"}
    for name in src_rows:
        assert dst_rows[name] == src_rows[name], name
    assert len(src_rows["usage"]) == 24 and len(src_rows["limits"]) == 6
    assert [(t.name, t.rows) for t in seen] == [(t.name, len(src_rows[t.name])) for t in copy_order()]
    assert result.tables == tuple(seen) and result.rows == sum(len(src_rows[t.name]) for t in copy_order())
    # The used claim's emptied secret is still an empty text, not a NULL.
    assert sorted(r.sealed == "" for r in await _claims(destination)) == [False, True]

    secrets = [made.project_key, made.personal_key, made.revoked_key, "llmgw-" + "x" * 40]
    async with await Store.open(source) as src, await Store.open(destination) as dst:
        want = await _principals(src, secrets)
        assert await _principals(dst, secrets) == want
        assert want[0].band == "high" and want[0].pools and want[2] == ("refused", "revoked_api_key")
        assert await _budgets(dst) == await _budgets(src) != []
        assert await dst.get_limits("project", want[0].project_id) == await src.get_limits(
            "project", want[0].project_id
        )
        assert (await dst.verify_password(made.admin_email, PASSWORD)) is not None
        assert (await dst.session_user(made.session_token, now_touch=False)) is not None
        assert (await dst.admin_token_by_secret(made.admin_token)) is not None
        assert await dst.keys_generation() == await src.keys_generation()
        # A claim link sent before the move opens its key from the new store.
        (opened,) = await _principals(dst, [await dst.claim_key(made.claim_token)])
        assert getattr(opened, "project", None) == "Acme/platform/gateway", opened

        # New rows get new ids: PostgreSQL's sequences were moved past the copied ones.
        await dst.insert_usage(
            [UsageRow(model="tiny", endpoint="/v1/completions", status=200, latency_ms=1.0, request_id="after")]
        )
        await dst.set_limits("key", want[0].key_id, rpm=8)
        async with dst.engine.connect() as conn:
            newest = await conn.scalar(select(usage.c.id).where(usage.c.request_id == "after"))
            assert newest == max(r[0] for r in src_rows["usage"]) + 1
            assert await conn.scalar(select(func.max(limit_changes.c.id))) == len(src_rows["limit_changes"]) + 1


async def _claims(address: str):
    engine = create_async_engine(resolve_store_address(address))
    try:
        async with engine.connect() as conn:
            return (await conn.execute(text("SELECT sealed FROM key_claims"))).all()
    finally:
        await engine.dispose()


async def test_a_store_moved_to_postgresql_and_back_to_sqlite_is_the_store_it_was(tmp_path, pg):
    source, back = str(tmp_path / "llmgw.db"), str(tmp_path / "back.db")
    await _populate(source)
    await move_store(source, pg)
    await _no_sessions_on(pg)

    await move_store(pg, back)

    assert await _all_rows(back) == await _all_rows(source)


async def test_the_copy_order_puts_every_table_after_those_its_migrated_foreign_keys_name(address):
    """The order comes from the schema module; the foreign keys here come from a store the
    migrations made, so the two cannot drift apart unnoticed."""
    async with await Store.open(address) as s, s.engine.connect() as conn:
        migrated = await conn.run_sync(
            lambda c: {
                t: inspect(c).get_foreign_keys(t) for t in inspect(c).get_table_names() if not is_derived_table(t)
            }
        )
    order = [t.name for t in copy_order()]
    assert set(order) == set(migrated) - {"alembic_version"}
    edges = [(t, fk["referred_table"]) for t, fks in migrated.items() for fk in fks]
    assert edges  # the tree, memberships, claims and sessions all refer to other tables
    for child, parent in edges:
        assert order.index(parent) < order.index(child), (child, parent)


async def test_every_column_the_migrations_create_is_one_the_copy_carries(address):
    async with await Store.open(address) as s, s.engine.connect() as conn:
        migrated = await conn.run_sync(
            lambda c: {
                t: {col["name"] for col in inspect(c).get_columns(t)}
                for t in inspect(c).get_table_names()
                if not is_derived_table(t)  # SQLite's note search, rebuilt by triggers as notes are copied
            }
        )
    assert {t.name: {c.name for c in t.columns} for t in copy_order()} == {
        t: cols for t, cols in migrated.items() if t != "alembic_version"
    }


def test_the_command_moves_a_store_into_postgresql_and_refuses_a_second_time(tmp_path, pg):
    source = str(tmp_path / "llmgw.db")
    asyncio.run(_populate(source))
    dsn_file = tmp_path / "store-dsn"
    dsn_file.write_text(pg + "\n")

    def move():
        return subprocess.run(
            [sys.executable, "-m", "llmgw.cli.main", "keys", "move-store", "--from", source, "--to", f"@{dsn_file}"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )

    first = move()
    assert first.returncode == 0, first.stderr
    assert "moved " in first.stdout and f"from {source} to " in first.stdout
    usage_rows = len(asyncio.run(_all_rows(source))["usage"])
    assert f"copied usage: {usage_rows} rows" in first.stderr
    assert first.stderr.index("copied organizations") < first.stderr.index("copied teams")
    copied = asyncio.run(_all_rows(pg))

    second = move()
    assert second.returncode == 1
    assert "is not empty" in second.stderr and f"usage ({usage_rows} rows)" in second.stderr
    assert asyncio.run(_all_rows(pg)) == copied

    listed = subprocess.run(
        [sys.executable, "-m", "llmgw.cli.main", "keys", "list", "--all", "--json", "--store", f"@{dsn_file}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert listed.returncode == 0, listed.stderr
    assert '"name": "ci"' in listed.stdout and '"state": "revoked"' in listed.stdout


# -- refusals -------------------------------------------------------------------------


async def test_a_destination_holding_rows_is_refused_by_name_and_left_as_it_was(tmp_path, destination):
    source = str(tmp_path / "llmgw.db")
    await _populate(source)
    async with await Store.open(destination) as d:
        await d.add("org", "Other")
        await d.create_key("theirs")
    before, source_before = await _all_rows(destination), Path(source).read_bytes()

    with pytest.raises(StoreError, match=r"is not empty: api_keys \(1 row\), organizations \(1 row\)\. "):
        await move_store(source, destination)

    assert await _all_rows(destination) == before
    assert Path(source).read_bytes() == source_before


async def test_a_postgresql_database_holding_other_tables_is_refused_and_gets_none_of_llmgws(tmp_path, pg):
    source = str(tmp_path / "llmgw.db")
    await _populate(source)
    await pg_exec(pg, "CREATE TABLE orders (id int primary key)")

    with pytest.raises(StoreError, match=r"holds tables that are not llmgw's \(orders\)"):
        await move_store(source, pg)

    engine = create_async_engine(resolve_store_address(pg))
    try:
        async with engine.connect() as conn:
            assert await conn.run_sync(lambda c: inspect(c).get_table_names()) == ["orders"]
    finally:
        await engine.dispose()


async def test_moving_a_store_onto_itself_is_refused_however_its_address_is_spelled(tmp_path):
    source = str(tmp_path / "llmgw.db")
    await _populate(source)
    (tmp_path / "link.db").symlink_to(source)
    (tmp_path / "store-address").write_text(f"{tmp_path}/sub/../llmgw.db\n")
    (tmp_path / "sub").mkdir()
    before = Path(source).read_bytes()
    for same in (source, str(tmp_path / "link.db"), f"@{tmp_path / 'store-address'}"):
        with pytest.raises(StoreError, match="--from and --to are the same store"):
            await move_store(source, same)
    assert Path(source).read_bytes() == before


async def test_a_missing_source_is_refused_and_nothing_is_created(tmp_path):
    with pytest.raises(StoreError, match="There is no store at .*typo/llmgw.db to move"):
        await move_store(str(tmp_path / "typo" / "llmgw.db"), str(tmp_path / "new.db"))
    with pytest.raises(StoreError, match="There is no store at .*absent.db to move"):
        await move_store(str(tmp_path / "absent.db"), str(tmp_path / "new.db"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("version", "says"),
    [
        ("0006", rf"the schema of an older llmgw \(0006; this llmgw's is {revisions()[0]}\)\. Migrate it first"),
        ("0099", r"the schema 0099, which a newer llmgw wrote .* run move-store with that llmgw"),
    ],
)
async def test_a_source_with_another_schema_version_is_refused_saying_what_to_run(tmp_path, version, says):
    source = str(tmp_path / "llmgw.db")
    await _populate(source)
    with sqlite3.connect(source) as db:
        db.execute("UPDATE alembic_version SET version_num = ?", (version,))
    db.close()
    destination = tmp_path / "moved.db"

    with pytest.raises(StoreError, match=says):
        await move_store(source, str(destination))

    assert not destination.exists()  # refused before the destination was touched


async def test_a_sqlite_source_another_process_has_open_is_refused_until_that_process_ends(tmp_path):
    source = str(tmp_path / "llmgw.db")
    await _populate(source)
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import asyncio, sys\n"
        "from llmgw.store import Store\n"
        "async def main():\n"
        "    s = await Store.open(sys.argv[1])\n"
        "    await s.keys_generation()\n"  # a pooled connection stays open, as a gateway's does
        "    print('open', flush=True)\n"
        "    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)\n"
        "    await s.close()\n"
        "asyncio.run(main())\n",
        source,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert await asyncio.wait_for(holder.stdout.readline(), 60) == b"open\n"
        with pytest.raises(StoreError, match=rf"open in another process \(pid {holder.pid}\); stop the gateway"):
            await move_store(source, str(tmp_path / "moved.db"))
        assert not (tmp_path / "moved.db").exists()
        holder.stdin.close()
        assert await asyncio.wait_for(holder.wait(), 60) == 0
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()

    result = await move_store(source, str(tmp_path / "moved.db"))
    assert result.rows > 0


async def test_a_postgresql_source_with_another_session_is_refused_until_it_closes(tmp_path, pg):
    await _populate(pg)
    await _no_sessions_on(pg)
    gateway = await Store.open(pg)  # its pooled connection stays, as a running gateway's does
    try:
        await gateway.keys_generation()
        with pytest.raises(StoreError, match=r"is in use: 1 other session\(s\) of postgres are connected"):
            await move_store(pg, str(tmp_path / "moved.db"))
    finally:
        await gateway.close()
    await _no_sessions_on(pg)

    result = await move_store(pg, str(tmp_path / "moved.db"))
    assert result.rows > 0


async def test_a_table_postgresql_refuses_midway_leaves_the_destination_empty_and_a_rerun_succeeds(tmp_path, pg):
    source = str(tmp_path / "llmgw.db")
    await _populate(source)
    # SQLite does not hold a VARCHAR to its length; PostgreSQL refuses the row. The tables
    # before catalog_models in the order (admin_tokens, agent_storage, api_keys) were copied by then.
    with sqlite3.connect(source) as db:
        db.execute(
            "INSERT INTO catalog_models VALUES (?, '{}', '2025-01-01 00:00:00.000000', '2025-01-01 00:00:00.000000')",
            ("m" * 201,),
        )
    db.close()
    order = [t.name for t in copy_order()]
    assert order.index("api_keys") < order.index("catalog_models")

    with pytest.raises(StoreError) as refused:
        await move_store(source, pg)

    message = str(refused.value)
    assert "Copying the table catalog_models" in message
    assert "the tables copied before it (admin_tokens, agent_storage, api_keys) were emptied again" in message
    after = await _all_rows(pg)
    assert all(after[t.name] == [] for t in copy_order() if t is not store_state)
    assert after["store_state"] == [("keys_generation", 0)]  # as the migrations left it

    with sqlite3.connect(source) as db:
        db.execute("DELETE FROM catalog_models WHERE length(name) > 200")
    db.close()
    await move_store(source, pg)
    assert (await _all_rows(pg))["api_keys"] == (await _all_rows(source))["api_keys"]
