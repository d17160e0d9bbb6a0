"""The store on both backends: SQLite in tmp_path, PostgreSQL in a throwaway database."""

from __future__ import annotations

import asyncio
import re
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text, update

from llmgw.store import AmbiguousKey, KeyAlreadyRevoked, KeyNotFound, Store, StoreError, UsageRow, hash_secret
from llmgw.store.migrate import revisions
from llmgw.store.schema import api_keys

UTC = UTC
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def store(address):
    s = await Store.open(address)
    yield s
    await s.close()


async def _all_rows(store: Store) -> dict[str, list[tuple]]:
    async with store.engine.connect() as conn:
        return {
            t: [tuple(r) for r in await conn.execute(text(f"SELECT * FROM {t}"))]
            for t in ("api_keys", "usage", "store_state", "alembic_version")
        }


# -- opening and migrations -------------------------------------------------------


async def test_open_twice_is_idempotent(address):
    s = await Store.open(address)
    _, rec = await s.create_key("first")
    await s.close()
    s = await Store.open(address)
    try:
        assert [k.id for k in await s.list_keys()] == [rec.id]
        assert await s.keys_generation() == 1
        rows = await _all_rows(s)
        assert rows["alembic_version"] == [(revisions()[0],)]
        assert rows["store_state"] == [("keys_generation", 1)]
    finally:
        await s.close()


async def test_concurrent_opens_of_fresh_database(address):
    stores = await asyncio.wait_for(asyncio.gather(*(Store.open(address) for _ in range(4))), 30)
    try:
        assert [await s.keys_generation() for s in stores] == [0, 0, 0, 0]
        assert (await _all_rows(stores[0]))["store_state"] == [("keys_generation", 0)]
    finally:
        for s in stores:
            await s.close()


async def test_concurrent_processes_open_fresh_database(address):
    # Separate processes, each released once all have finished importing.
    code = (
        "import asyncio, sys\n"
        "from llmgw.store import Store\n"
        "async def main():\n"
        "    s = await Store.open(sys.argv[1])\n"
        "    print(await s.keys_generation())\n"
        "    await s.close()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "asyncio.run(main())\n"
    )
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            address,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(3)
    ]
    for p in procs:
        assert await asyncio.wait_for(p.stdout.readline(), 30) == b"ready\n"
    for p in procs:
        p.stdin.write(b"go\n")
    results = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 60)
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err.decode()
        assert out.decode().strip() == "0"


async def test_concurrent_opens_of_different_databases(tmp_path):
    # Alembic's proxies are module globals; migrations on one loop must not interleave.
    opens = [Store.open(str(tmp_path / f"db{i}.sqlite")) for i in range(3)]
    stores = await asyncio.wait_for(asyncio.gather(*opens), 30)
    try:
        for s in stores:
            assert await s.keys_generation() == 0
            assert (await _all_rows(s))["alembic_version"] == [(revisions()[0],)]
    finally:
        for s in stores:
            await s.close()


async def test_unreachable_postgres_error_masks_password():
    with pytest.raises(StoreError) as e:
        await Store.open("postgresql://bob:s3cr3t@127.0.0.1:1/llmgw")
    msg = str(e.value)
    assert "s3cr3t" not in msg and "bob:***@127.0.0.1:1/llmgw" in msg
    assert "Check that PostgreSQL is running there" in msg


async def test_postgres_parameters_reach_the_driver(pg_database):
    params = "sslmode=disable&connect_timeout=5&command_timeout=10&prepared_statement_cache_size=0"
    s = await Store.open(f"{pg_database}?{params}")
    try:
        assert await s.keys_generation() >= 0
    finally:
        await s.close()


async def test_not_a_sqlite_file(tmp_path):
    bad = tmp_path / "junk.db"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="Could not open the store at .*junk.db"):
        await Store.open(str(bad))


async def test_at_file_address(address, tmp_path):
    f = tmp_path / "store-address"
    f.write_text(address + "\n")
    s = await Store.open(f"@{f}")
    try:
        await s.create_key("via file")
    finally:
        await s.close()
    s = await Store.open(address)
    try:
        assert [k.name for k in await s.list_keys()] == ["via file"]
    finally:
        await s.close()


# -- keys ---------------------------------------------------------------------------


async def test_a_created_key_is_listed_with_its_values_and_only_its_hash_is_kept(store):
    before = datetime.now(UTC)
    secret, rec = await store.create_key("  ci bot ", project="team-a")
    assert re.fullmatch(r"llmgw-[A-Za-z0-9_-]{40}", secret)
    assert re.fullmatch(r"key-[0-9a-f]{12}", rec.id)
    assert rec.prefix == secret[:14] and rec.name == "ci bot" and rec.project == "team-a"
    assert before <= rec.created_at <= datetime.now(UTC)
    assert rec.revoked_at is rec.last_used_at is rec.expires_at is None
    listed = await store.list_keys()
    assert listed == [rec]  # same values back, timestamps included, aware UTC
    assert listed[0].created_at.tzinfo is not None
    (active,) = await store.active_keys()
    assert active.hash == hash_secret(secret) and active.id == rec.id


@pytest.mark.parametrize(
    "name, needle",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("x" * 201, "at most 200"),
        ("a\nb", "control characters"),
        (None, "must be text"),
    ],
    ids=["empty", "blank", "too-long", "newline", "none"],
)
async def test_bad_key_names_change_nothing(store, name, needle):
    with pytest.raises(StoreError, match=needle):
        await store.create_key(name)
    assert await store.list_keys() == [] and await store.keys_generation() == 0


async def test_name_of_200_characters_is_fine(store):
    _, rec = await store.create_key("n" * 200)
    assert rec.name == "n" * 200


async def test_a_key_expiry_must_be_timezone_aware_and_in_the_future(store):
    with pytest.raises(StoreError, match="timezone-aware"):
        await store.create_key("k", expires_at=datetime.now() + timedelta(days=1))
    with pytest.raises(StoreError, match="in the past"):
        await store.create_key("k", expires_at=datetime.now(UTC) - timedelta(seconds=1))
    assert await store.keys_generation() == 0


async def test_secret_never_stored(store, address):
    made = [await store.create_key(f"k{i}") for i in range(3)]
    await store.insert_usage(
        [UsageRow(key_id=r.id, model="m", endpoint="/v1/chat/completions", status=200, latency_ms=1.0) for _, r in made]
    )
    await store.revoke_key(made[0][1].id)
    dump = repr(await _all_rows(store))
    for secret, _ in made:
        assert secret not in dump and secret[14:] not in dump and secret[6:] not in dump
        assert hash_secret(secret) in dump
    if not address.startswith("postgres"):
        # Also the raw SQLite file and its write-ahead log.
        raw = b"".join(p.read_bytes() for p in Path(address).parent.glob("store.db*"))
        for secret, _ in made:
            assert secret[14:].encode() not in raw


async def test_generation_counts_creates_and_revokes(store):
    assert await store.keys_generation() == 0
    _, a = await store.create_key("a")
    _, b = await store.create_key("b")
    assert await store.keys_generation() == 2
    await store.revoke_key(a.id)
    assert await store.keys_generation() == 3
    for bad in (a.id, "key-000000000000"):
        with pytest.raises(StoreError):
            await store.revoke_key(bad)
    await store.insert_usage([UsageRow(key_id=b.id, model="m", endpoint="/e", status=200, latency_ms=1.0)])
    assert await store.keys_generation() == 3  # failures and usage do not count


async def test_revoke_by_id(store):
    _, a = await store.create_key("a")
    _, b = await store.create_key("b")
    revoked = await store.revoke_key(f"  {a.id} ")
    assert revoked.id == a.id and revoked.revoked_at is not None
    assert [k.id for k in await store.list_keys(include_revoked=False)] == [b.id]
    assert [k.id for k in await store.list_keys()] == [a.id, b.id]
    assert [k.id for k in await store.active_keys()] == [b.id]
    (stored,) = [k for k in await store.list_keys() if k.id == a.id]
    assert stored.revoked_at == revoked.revoked_at


async def test_revoke_by_prefix_and_leading_part(store):
    _, a = await store.create_key("a")
    _, b = await store.create_key("b")
    assert (await store.revoke_key(a.prefix)).id == a.id
    assert (await store.revoke_key(b.prefix[:8])).id == b.id


async def test_revoke_by_full_secret(store):
    secret, a = await store.create_key("a")
    assert (await store.revoke_key(secret)).id == a.id


async def test_revoke_ambiguous_lists_candidates(store):
    _, a = await store.create_key("alpha")
    _, b = await store.create_key("beta")
    with pytest.raises(AmbiguousKey) as e:
        await store.revoke_key("llmgw-")  # six characters every prefix shares
    assert {k.id for k in e.value.candidates} == {a.id, b.id}
    assert a.id in str(e.value) and b.id in str(e.value) and "'alpha'" in str(e.value)
    assert await store.list_keys(include_revoked=False) != [] and await store.keys_generation() == 2


async def test_revoking_an_unknown_key_refuses_without_echoing_the_secret(store):
    secret, a = await store.create_key("a")
    with pytest.raises(KeyNotFound, match="No API key matches 'key-ffffffffffff'"):
        await store.revoke_key("key-ffffffffffff")
    with pytest.raises(KeyNotFound, match="shorter than 6"):
        await store.revoke_key(a.prefix[:5])
    with pytest.raises(KeyNotFound, match="Give the id"):
        await store.revoke_key("  ")
    # Neither case-folded nor wildcard matches.
    with pytest.raises(KeyNotFound):
        await store.revoke_key(a.prefix.swapcase() if a.prefix[6:] != a.prefix[6:].swapcase() else "llmgw-________")
    # A wrong full secret is not echoed back.
    wrong = secret[:14] + "x" * 40
    with pytest.raises(KeyNotFound) as e:
        await store.revoke_key(wrong)
    assert wrong not in str(e.value)
    assert await store.keys_generation() == 1


async def test_revoke_already_revoked_says_when(store):
    _, a = await store.create_key("a")
    first = await store.revoke_key(a.id)
    with pytest.raises(KeyAlreadyRevoked) as e:
        await store.revoke_key(a.prefix)
    assert first.revoked_at.isoformat() in str(e.value)
    assert e.value.key.revoked_at == first.revoked_at
    assert await store.keys_generation() == 2


async def test_expired_keys_are_not_active(store):
    _, soon = await store.create_key("soon", expires_at=datetime.now(UTC) + timedelta(hours=1))
    _, later = await store.create_key("later", expires_at=datetime.now(UTC) + timedelta(days=9))
    _, never = await store.create_key("never")
    assert {k.id for k in await store.active_keys()} == {soon.id, later.id, never.id}
    # Move one expiry into the past rather than sleeping past it.
    async with store.engine.begin() as conn:
        await conn.execute(
            update(api_keys).where(api_keys.c.id == soon.id).values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    assert {k.id for k in await store.active_keys()} == {later.id, never.id}
    (rec,) = [k for k in await store.list_keys() if k.id == soon.id]
    assert not rec.is_active() and later.is_active() and never.is_active()


# -- usage --------------------------------------------------------------------------


async def test_usage_batch_and_last_used(store):
    _, a = await store.create_key("a")
    _, b = await store.create_key("b")
    t0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
    rows = [
        UsageRow(
            key_id=a.id,
            project="p",
            model="llama",
            served_model="llama-3b-q4",
            endpoint="/v1/chat/completions",
            prompt_tokens=10,
            completion_tokens=5,
            latency_ms=12.5,
            ttft_ms=3.25,
            status=200,
            stream=True,
            at=t0,
        ),
        UsageRow(
            key_id=a.id,
            model="llama",
            endpoint="/v1/completions",
            latency_ms=7.0,
            status=200,
            at=t0 + timedelta(seconds=5),
        ),
        UsageRow(
            key_id=b.id,
            model="qwen",
            endpoint="/v1/embeddings",
            latency_ms=1.0,
            status=429,
            at=t0 + timedelta(seconds=2),
        ),
        UsageRow(model="x", endpoint="/v1/models", latency_ms=0.5, status=401, at=t0 + timedelta(seconds=1)),
    ]
    await store.insert_usage(rows)
    await store.insert_usage([])
    assert await store.count_usage() == 4
    got = await store.list_usage()
    assert [r.at for r in got] == sorted((r.at for r in rows), reverse=True)
    assert all(r.id is not None for r in got)
    first = next(r for r in got if r.at == t0)
    assert first == UsageRow(**{**{f: getattr(rows[0], f) for f in UsageRow.__slots__}, "id": first.id})
    assert [r.endpoint for r in await store.list_usage(key_id=a.id)] == ["/v1/completions", "/v1/chat/completions"]
    assert len(await store.list_usage(limit=2)) == 2
    keys = {k.id: k for k in await store.list_keys()}
    assert keys[a.id].last_used_at == t0 + timedelta(seconds=5)
    assert keys[b.id].last_used_at == t0 + timedelta(seconds=2)
    # An older batch arriving late does not move last_used_at back.
    await store.insert_usage([UsageRow(key_id=a.id, model="m", endpoint="/e", status=200, latency_ms=1.0, at=t0)])
    assert {k.id: k for k in await store.list_keys()}[a.id].last_used_at == t0 + timedelta(seconds=5)
    assert await store.count_usage() == 5


async def test_usage_default_time_is_now_utc(store):
    before = datetime.now(UTC)
    await store.insert_usage([UsageRow(model="m", endpoint="/e", status=200, latency_ms=1.0)])
    (row,) = await store.list_usage()
    assert row.at.tzinfo is not None and before <= row.at <= datetime.now(UTC)
    assert row.key_id is None and row.prompt_tokens == 0 and row.stream is False


async def test_revoked_key_hashes(store):
    secret, rec = await store.create_key("gone")
    await store.create_key("kept")
    assert await store.revoked_key_hashes() == []
    revoked = await store.revoke_key(rec.id)
    assert await store.revoked_key_hashes() == [(hash_secret(secret), revoked.revoked_at)]


# -- node marks ---------------------------------------------------------------------


async def test_node_marks_set_replace_clear_and_refuse(address):
    s = await Store.open(address)
    try:
        assert await s.node_marks_list() == {}
        await s.node_mark_set("node-1", "cordoned")
        await s.node_mark_set("node-2", "draining")
        await s.node_mark_set("node-1", "draining")
        assert await s.node_marks_list() == {"node-1": "draining", "node-2": "draining"}
        await s.node_mark_set("node-2", None)
        assert await s.node_marks_list() == {"node-1": "draining"}
        with pytest.raises(StoreError, match='"cordoned" or "draining"'):
            await s.node_mark_set("node-3", "asleep")
        assert await s.node_marks_list() == {"node-1": "draining"}
    finally:
        await s.close()
