"""Browser sessions in the store, on both backends: only the token's hash is kept, a
session lives while it has not expired and its person is active, and signing out,
suspending or deleting a person ends them."""

from __future__ import annotations

import hashlib
import math
from datetime import timedelta

import pytest
from sqlalchemy import inspect, select, text, update

from llmgw.store import NotFound, SessionRecord, Store, StoreError
from llmgw.store.records import utcnow
from llmgw.store.schema import browser_sessions, users

DAY = 86400.0


@pytest.fixture
async def store(address):
    s = await Store.open(address)
    yield s
    await s.close()


async def _rows(store: Store) -> list:
    async with store.engine.connect() as conn:
        return list(await conn.execute(select(browser_sessions).order_by(browser_sessions.c.created_at)))


async def _set(store: Store, token: str, **values) -> None:
    digest = hashlib.sha256(token.encode()).hexdigest()
    async with store.engine.begin() as conn:
        await conn.execute(update(browser_sessions).where(browser_sessions.c.token_hash == digest).values(**values))


async def test_a_session_is_found_by_its_token_and_the_store_keeps_only_the_tokens_hash(store):
    ann = await store.create_user("ann@example.com", "correct horse")
    token, rec = await store.create_session(ann.id, DAY)
    assert isinstance(rec, SessionRecord) and rec.user_id == ann.id and rec.id.startswith("ses-")
    assert len(token) >= 43 and rec.id != token and rec.csrf and rec.csrf != token
    assert rec.last_seen_at == rec.created_at and rec.expires_at - rec.created_at == timedelta(seconds=DAY)
    (row,) = await _rows(store)
    assert row.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert token not in [str(v) for v in row]
    found = await store.session_user(token)
    assert found is not None
    got, person = found
    assert got == rec and (person.id, person.email, person.state) == (ann.id, "ann@example.com", "active")
    # Each sign-in is a session of its own.
    token2, rec2 = await store.create_session(ann.id, DAY)
    assert token2 != token and rec2.id != rec.id and rec2.csrf != rec.csrf


async def test_unknown_expired_and_malformed_tokens_find_no_session(store):
    ann = await store.create_user("ann@example.com", "correct horse")
    token, _ = await store.create_session(ann.id, DAY)
    for bad in ("", "nope", token + "x", "x" * 10_000, None, 42):
        assert await store.session_user(bad) is None, bad  # type: ignore[arg-type]
    await _set(store, token, expires_at=utcnow() - timedelta(seconds=1))
    assert await store.session_user(token) is None
    with pytest.raises(NotFound, match="sign in again"):
        await store.rotate_csrf(token)


async def test_suspending_or_deleting_a_person_signs_them_out_everywhere(store):
    ann = await store.create_user("ann@example.com", "correct horse")
    bob = await store.create_user("bob@example.com", "correct horse")
    t1, _ = await store.create_session(ann.id, DAY)
    t2, _ = await store.create_session(ann.id, DAY)
    tb, _ = await store.create_session(bob.id, DAY)
    await store.set_user_state(ann.id, "suspended")
    assert await store.session_user(t1) is None and await store.session_user(t2) is None
    # Reinstating does not bring the sessions back: they were ended, not hidden.
    await store.set_user_state(ann.id, "active")
    assert await store.session_user(t1) is None
    assert [r.user_id for r in await _rows(store)] == [bob.id]
    # Deleting removes the rows first (PostgreSQL enforces the foreign key to users).
    await store.delete_user(bob.id)
    assert await store.session_user(tb) is None and await _rows(store) == []


async def test_a_session_whose_person_is_not_active_finds_nobody_even_if_its_row_remains(store):
    ann = await store.create_user("ann@example.com", "correct horse")
    token, _ = await store.create_session(ann.id, DAY)
    # As an older llmgw, or a hand edit, might leave it: the state is checked on every read.
    async with store.engine.begin() as conn:
        await conn.execute(update(users).where(users.c.id == ann.id).values(state="suspended"))
    assert await store.session_user(token) is None
    assert len(await _rows(store)) == 1


async def test_last_seen_is_written_at_most_once_a_minute_not_on_every_request(store):
    ann = await store.create_user("ann@example.com", "correct horse")
    token, rec = await store.create_session(ann.id, DAY)
    for _ in range(3):
        found = await store.session_user(token)
        assert found is not None and found[0].last_seen_at == rec.last_seen_at
    (row,) = await _rows(store)
    assert row.last_seen_at == rec.last_seen_at
    old = utcnow() - timedelta(minutes=2)
    await _set(store, token, last_seen_at=old)
    found = await store.session_user(token, now_touch=False)
    assert found is not None and found[0].last_seen_at == old
    assert (await _rows(store))[0].last_seen_at == old
    before = utcnow()
    found = await store.session_user(token)
    assert found is not None and found[0].last_seen_at >= before
    assert (await _rows(store))[0].last_seen_at == found[0].last_seen_at


async def test_signing_out_ends_one_session_and_end_sessions_can_keep_the_current_one(store):
    ann = await store.create_user("ann@example.com", "correct horse")
    bob = await store.create_user("bob@example.com", "correct horse")
    t1, _ = await store.create_session(ann.id, DAY)
    t2, _ = await store.create_session(ann.id, DAY)
    t3, _ = await store.create_session(ann.id, DAY)
    tb, _ = await store.create_session(bob.id, DAY)
    await store.end_session(t1)
    assert await store.session_user(t1) is None and await store.session_user(t2) is not None
    await store.end_session(t1)  # already gone: fine
    await store.end_session("never-issued")
    assert await store.end_sessions(ann.id, except_token=t2) == 1
    assert await store.session_user(t3) is None and await store.session_user(t2) is not None
    assert await store.session_user(tb) is not None  # someone else's stay
    assert await store.end_sessions(ann.id) == 1
    assert await store.session_user(t2) is None
    assert await store.end_sessions(ann.id) == 0


async def test_a_password_change_keeps_the_current_session_with_a_new_csrf_token(store):
    ann = await store.create_user("ann@example.com", "correct horse")
    here, rec = await store.create_session(ann.id, DAY)
    elsewhere, _ = await store.create_session(ann.id, DAY)
    assert await store.check_password(ann.id, "correct horse")
    assert not await store.check_password(ann.id, "wrong horse")
    await store.set_password(ann.id, "battery staple")
    assert await store.check_password(ann.id, "battery staple") and not await store.check_password(
        ann.id, "correct horse"
    )
    assert await store.verify_password("ann@example.com", "battery staple") is not None
    assert await store.end_sessions(ann.id, except_token=here) == 1
    csrf = await store.rotate_csrf(here)
    assert csrf and csrf != rec.csrf
    found = await store.session_user(here)
    assert found is not None and found[0].csrf == csrf
    assert await store.session_user(elsewhere) is None
    with pytest.raises(StoreError, match="at least 8"):
        await store.set_password(ann.id, "short")
    with pytest.raises(NotFound):
        await store.set_password("usr-nobody0000", "long enough")
    assert not await store.check_password("usr-nobody0000", "battery staple")
    assert await store.check_password(ann.id, "battery staple")  # the refusals changed nothing


async def test_creating_a_session_sweeps_expired_ones(store):
    ann = await store.create_user("ann@example.com", "correct horse")
    old, _ = await store.create_session(ann.id, DAY)
    live, _ = await store.create_session(ann.id, DAY)
    await _set(store, old, expires_at=utcnow() - timedelta(seconds=1))
    _, rec = await store.create_session(ann.id, DAY)
    left = {r.id for r in await _rows(store)}
    assert len(left) == 2 and rec.id in left
    assert await store.session_user(live) is not None


async def test_a_session_is_only_for_an_active_person_and_a_lifetime_above_zero(store):
    ann = await store.create_user("ann@example.com", "correct horse")
    for ttl in (0, -5, math.nan, math.inf, True, "3600"):
        with pytest.raises(StoreError, match="lifetime"):
            await store.create_session(ann.id, ttl)  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        await store.create_session("usr-nobody0000", DAY)
    pending = await store.sign_up("new@example.com", "correct horse")
    with pytest.raises(StoreError, match="pending"):
        await store.create_session(pending.id, DAY)
    await store.set_user_state(ann.id, "suspended")
    with pytest.raises(StoreError, match="suspended"):
        await store.create_session(ann.id, DAY)
    assert await _rows(store) == []


async def test_the_0006_migration_adds_sessions_to_a_0005_store_and_downgrades_cleanly(address):
    from alembic import command

    from llmgw.store.address import resolve_store_address
    from llmgw.store.migrate import _alembic_config
    from llmgw.store.store import _create_engine

    engine = _create_engine(resolve_store_address(address))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda c: command.upgrade(_alembic_config(c), "0005"))
            await conn.execute(
                users.insert().values(
                    id="usr-old0000000",
                    email="old@example.com",
                    state="active",
                    admin=False,
                    created_at=utcnow(),
                )
            )
    finally:
        await engine.dispose()
    async with await Store.open(address) as s:
        token, _ = await s.create_session("usr-old0000000", DAY)
        found = await s.session_user(token)
        assert found is not None and found[1].email == "old@example.com"
        await s.end_sessions("usr-old0000000")
        async with s.engine.begin() as conn:
            await conn.run_sync(lambda c: command.downgrade(_alembic_config(c), "0005"))
            version = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()
            assert version == "0005"
            names = await conn.run_sync(lambda c: inspect(c).get_table_names())
            assert "browser_sessions" not in names and "users" in names
