"""What the administrator's pages read from the store, on SQLite and PostgreSQL: the log of limit changes
(written by set_limits in its own transaction, migration 0007), spend per place in the tree, and usage
in time buckets."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import inspect, text

from llmgw.store import Store, StoreError, UsageRow


@pytest.fixture
async def store(address):
    s = await Store.open(address)
    yield s
    await s.close()


async def test_every_limit_change_is_logged_with_who_and_the_row_before_and_a_write_changing_nothing_is_not(store):
    org = await store.add_org("Acme")
    await store.set_limits("org", org.id, rpm=10)
    await store.set_limits("org", org.id, rpm=10)
    await store.set_limits("org", org.id, per_member=True, models=[], changed_by="root@example.com")
    await store.set_limits("org", org.id, tpm=99, changed_by="root@example.com")
    await store.set_limits("org", org.id, clear=True, changed_by="ops@example.com")
    changes = await store.limit_changes()
    assert [
        (c.changed_by, c.scope, c.old and (c.old.rpm, c.old.tpm), c.new and (c.new.rpm, c.new.tpm)) for c in changes
    ] == [
        ("ops@example.com", "org", (10, 99), None),
        ("root@example.com", "org", (10, None), (10, 99)),
        ("root@example.com", "org-member", None, (None, None)),
        (None, "org", None, (10, None)),
    ]
    assert changes[2].new.models == () and all(c.scope_id == org.id for c in changes)
    assert [c.at for c in changes] == sorted((c.at for c in changes), reverse=True)
    assert len(await store.limit_changes(limit=1)) == 1
    with pytest.raises(StoreError):
        await store.limit_changes(limit=0)


async def test_a_refused_limit_change_logs_nothing(store):
    org = await store.add_org("Acme")
    with pytest.raises(StoreError):
        await store.set_limits("org", org.id, period="week", changed_by="root@example.com")
    assert await store.limit_changes() == []


async def test_spend_is_summed_per_place_and_person_for_today_this_month_and_the_recent_days(store):
    now = datetime.now(UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    month = day.replace(day=1)
    where = {"org_id": "org-a", "team_id": "team-a", "project_id": "proj-a"}

    def row(at: datetime, cost: int, user: str | None = "usr-a") -> UsageRow:
        return UsageRow(
            model="m", endpoint="e", status=200, latency_ms=1, at=at, cost_micros=cost, user_id=user, **where
        )

    await store.insert_usage(
        [
            row(now, 5),
            row(now - timedelta(seconds=1), 7, None),
            row(day - timedelta(seconds=1), 100),  # yesterday: this month unless today is the 1st
            row(now - timedelta(days=40), 1000),  # too old for any of them
            row(now, 0),  # free: not a row of spend
        ]
    )
    got = {s.user_id: s for s in await store.spend_by_place(now - timedelta(days=30), day, month)}
    assert set(got) == {"usr-a", None}
    assert got["usr-a"].today == 5 and got["usr-a"].recent == 105
    assert got["usr-a"].this_month == (105 if day != month else 5)
    assert (got[None].today, got[None].this_month, got[None].recent) == (7, 7, 7)
    assert got["usr-a"].project_id == "proj-a" and got["usr-a"].org_id == "org-a"


async def test_usage_is_counted_in_buckets_from_the_start_per_group(store):
    since = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)

    def row(minutes: float, project: str | None, prompt: int = 1, cost: int = 0) -> UsageRow:
        return UsageRow(
            model="m",
            endpoint="e",
            status=200,
            latency_ms=1,
            at=since + timedelta(minutes=minutes),
            project_id=project,
            prompt_tokens=prompt,
            completion_tokens=2,
            cost_micros=cost,
        )

    await store.insert_usage(
        [
            row(-0.01, "p1"),  # before the window
            row(0, "p1", cost=3),
            row(4.99, "p1"),
            row(5, "p1"),
            row(59.99, "p2", prompt=10, cost=4),
            row(60, "p2"),  # the end is not in the window
            row(30, None),
        ]
    )
    got = await store.usage_buckets("project", since, since + timedelta(hours=1), 300)
    assert sorted((b.group_id or "", b.bucket, b.requests, b.tokens, b.cost_micros) for b in got) == [
        ("", 6, 1, 3, 0),
        ("p1", 0, 2, 6, 3),
        ("p1", 1, 1, 3, 0),
        ("p2", 11, 1, 12, 4),
    ]
    by_org = await store.usage_buckets("org", since, since + timedelta(hours=1), 3600)
    assert [(b.group_id, b.bucket, b.requests) for b in by_org] == [(None, 0, 5)]
    with pytest.raises(StoreError, match="grouped by"):
        await store.usage_buckets("model", since, since + timedelta(hours=1), 300)
    with pytest.raises(StoreError, match="at most"):
        await store.usage_buckets("org", since, since + timedelta(days=30), 1)


async def test_the_0007_migration_adds_the_log_to_a_0006_store_and_downgrades_cleanly(address):
    from alembic import command

    from llmgw.store.address import resolve_store_address
    from llmgw.store.migrate import _alembic_config
    from llmgw.store.store import _create_engine

    engine = _create_engine(resolve_store_address(address))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda c: command.upgrade(_alembic_config(c), "0006"))
    finally:
        await engine.dispose()
    async with await Store.open(address) as s:
        org = await s.add_org("Acme")
        await s.set_limits("org", org.id, rpm=1, changed_by="root@example.com")
        assert [c.changed_by for c in await s.limit_changes()] == ["root@example.com"]
        async with s.engine.begin() as conn:
            await conn.run_sync(lambda c: command.downgrade(_alembic_config(c), "0006"))
            version = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()
            assert version == "0006"
            names = await conn.run_sync(lambda c: inspect(c).get_table_names())
            assert "limit_changes" not in names and "limits" in names
