"""Conversations, stored responses and memory notes in the store, on both backends."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from alembic import command
from sqlalchemy import func, inspect, select, text, update

from llmgw.store import NotFound, Store, StoreError, Swept
from llmgw.store.agents import MAX_NOTE_BYTES, Quota
from llmgw.store.errors import QuotaFull
from llmgw.store.migrate import _alembic_config
from llmgw.store.move import move_store
from llmgw.store.records import utcnow
from llmgw.store.schema import memory_notes, project_retention, stored_responses, thread_messages, threads

AGENT_TABLES = ("project_retention", "threads", "thread_messages", "stored_responses", "memory_notes")


@pytest.fixture
async def store(address):
    s = await Store.open(address)
    yield s
    await s.close()


@pytest.fixture
async def acme(store):
    """Two projects, gateway and billing, in Acme/platform; returns their ids."""
    await store.add_org("Acme")
    await store.add_team("platform", "Acme")
    gateway = await store.add_project("gateway", "Acme/platform")
    billing = await store.add_project("billing", "Acme/platform")
    return gateway.id, billing.id


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


async def age(store: Store, table, column: str, hours: float, **where) -> None:
    """Move a row's time back by hours: how a test makes something old without waiting."""
    cond = [table.c[k] == v for k, v in where.items()]
    async with store.engine.begin() as conn:
        await conn.execute(update(table).where(*cond).values({column: utcnow() - timedelta(hours=hours)}))


async def count(store: Store, table) -> int:
    async with store.engine.connect() as conn:
        return int(await conn.scalar(select(func.count()).select_from(table)))


# -- retention settings -------------------------------------------------------------------


async def test_retention_is_set_per_project_turned_off_and_listed_and_bumps_the_keys_generation(store, acme):
    gateway, billing = acme
    assert await store.retention_settings() == []
    before = await store.keys_generation()

    got = await store.set_retention("Acme/platform/gateway", "threads", 72)
    assert (got.project_id, got.project_path, got.threads_hours, got.memory_hours) == (
        gateway,
        "Acme/platform/gateway",
        72,
        None,
    )
    assert await store.keys_generation() == before + 1
    await store.set_retention("gateway", "memory", 24)  # a unique name works as well as a path
    await store.set_retention(billing, "memory", 5)  # and an id

    settings = await store.retention_settings()
    assert [(r.project_path, r.threads_hours, r.memory_hours) for r in settings] == [
        ("Acme/platform/billing", None, 5),
        ("Acme/platform/gateway", 72, 24),
    ]
    # Off for one kind leaves the other; off for both lists the project no more.
    assert (await store.set_retention("gateway", "threads", None)).memory_hours == 24
    await store.set_retention("billing", "memory", None)
    assert [(r.project_path, r.threads_hours, r.memory_hours) for r in await store.retention_settings()] == [
        ("Acme/platform/gateway", None, 24)
    ]
    assert await count(store, project_retention) == 1
    assert await store.keys_generation() == before + 5


@pytest.mark.parametrize(
    ("project", "kind", "hours", "match"),
    [
        ("Acme/platform/nowhere", "threads", 1, r'No project at "Acme/platform/nowhere"; `llmgw org tree` shows'),
        ("nowhere", "memory", 1, 'No project is named "nowhere"'),
        ("gateway", "threads", 0, r"whole number of hours from 1 to 87,600, not 0; to keep no conversations, turn"),
        ("gateway", "memory", -3, r"How long notes are kept is a whole number of hours from 1 to 87,600, not -3"),
        ("gateway", "threads", 1.5, r"not 1\.5"),
        ("gateway", "threads", True, r"not True"),
        ("gateway", "threads", "72", r"not '72'"),
        ("gateway", "threads", 87_601, r"not 87601"),
        ("gateway", "chats", 1, r'The kind is "threads" \(conversations\) or "memory" \(notes\), not \'chats\''),
    ],
)
async def test_retention_refuses_an_unknown_project_kind_or_hours_that_are_no_window_and_changes_nothing(
    store, acme, project, kind, hours, match
):
    await store.set_retention("gateway", "threads", 12)
    before, settings = await store.keys_generation(), await store.retention_settings()
    with pytest.raises(StoreError, match=match):
        await store.set_retention(project, kind, hours)
    assert await store.keys_generation() == before
    assert await store.retention_settings() == settings


# -- threads --------------------------------------------------------------------------------


async def test_a_thread_reads_back_every_message_in_order_across_turns_and_remembers_the_last_model(store, acme):
    gateway, _ = acme
    assert await store.thread_messages(gateway, "t-1", 24) is None
    await store.append_thread(gateway, "t-1", [msg("system", "be brief"), msg("user", "hi")], "tiny")
    await store.append_thread(gateway, "t-1", [msg("assistant", "hello")], "tiny")
    turn = [msg("user", "ünïcode ✓ and a \ud800 lone surrogate"), {"role": "assistant", "content": None, "n": [1, 2]}]
    await store.append_thread(gateway, "t-1", turn, "big")

    assert await store.thread_messages(gateway, "t-1", 24) == [
        msg("system", "be brief"),
        msg("user", "hi"),
        msg("assistant", "hello"),
        *turn,
    ]
    async with store.engine.connect() as conn:
        row = (await conn.execute(select(threads).where(threads.c.thread_id == "t-1"))).one()
    assert row.model == "big" and row.last_turn_at >= row.created_at


async def test_another_projects_thread_reads_and_deletes_as_one_that_does_not_exist(store, acme):
    gateway, billing = acme
    await store.append_thread(gateway, "shared-name", [msg("user", "gateway's")], "tiny")
    assert await store.thread_messages(billing, "shared-name", 24) is None
    assert await store.delete_thread(billing, "shared-name") is False
    # The same id in another project is another thread.
    await store.append_thread(billing, "shared-name", [msg("user", "billing's")], "tiny")
    assert await store.thread_messages(gateway, "shared-name", 24) == [msg("user", "gateway's")]
    assert await store.thread_messages(billing, "shared-name", 24) == [msg("user", "billing's")]


async def test_the_shared_pool_and_the_projects_never_see_each_others_threads_responses_or_notes(store, acme):
    gateway, _ = acme
    await store.append_thread(None, "t", [msg("user", "pool")], "tiny")
    await store.append_thread(gateway, "t", [msg("user", "project")], "tiny")
    await store.append_thread(None, "t", [msg("user", "pool again")], "tiny")
    assert await store.thread_messages(None, "t", 1) == [msg("user", "pool"), msg("user", "pool again")]
    assert await store.thread_messages(gateway, "t", 1) == [msg("user", "project")]
    assert await store.thread_messages(None, "only-in-project", 1) is None

    await store.store_response(gateway, "resp_p", None, [msg("user", "p")])
    await store.store_response(None, "resp_pool", None, [msg("user", "q")])
    assert await store.response_history(None, "resp_p", 1) is None
    assert await store.response_history(gateway, "resp_pool", 1) is None
    with pytest.raises(NotFound, match="no stored response resp_p to continue"):
        await store.store_response(None, "resp_x", "resp_p", [msg("user", "steal")])

    pool_note = await store.create_note(None, "pool secret")
    project_note = await store.create_note(gateway, "project secret")
    assert await store.get_note(gateway, pool_note.id, 1) is None
    assert await store.get_note(None, project_note.id, 1) is None
    assert [n.id for n in await store.search_notes(None, "secret", 1)] == [pool_note.id]
    assert [n.id for n in await store.list_notes(gateway, 1)] == [project_note.id]
    assert await store.update_note(None, project_note.id, text="changed") is None
    assert await store.delete_note(None, project_note.id) is False
    assert await store.delete_thread(gateway, "t") is True
    assert await store.thread_messages(None, "t", 1) is not None


async def test_a_thread_past_its_window_reads_as_gone_before_any_sweep_and_a_new_turn_starts_it_afresh(store, acme):
    gateway, _ = acme
    await store.append_thread(gateway, "old", [msg("user", "long ago")], "tiny")
    await age(store, threads, "last_turn_at", 25, thread_id="old")
    assert await store.thread_messages(gateway, "old", 48) == [msg("user", "long ago")]  # a wider window keeps it

    assert await store.thread_messages(gateway, "old", 24) is None
    await store.append_thread(gateway, "old", [msg("user", "new start")], "tiny")
    assert await store.thread_messages(gateway, "old", 48) == [msg("user", "new start")]
    assert await count(store, thread_messages) == 1


async def test_deleting_a_thread_forgets_it_and_its_messages(store, acme):
    gateway, _ = acme
    await store.append_thread(gateway, "t", [msg("user", "a"), msg("assistant", "b")], "tiny")
    await store.append_thread(gateway, "keep", [msg("user", "c")], "tiny")
    assert await store.delete_thread(gateway, "t") is True
    assert await store.thread_messages(gateway, "t", 24) is None
    assert await store.delete_thread(gateway, "t") is False
    assert (await count(store, threads), await count(store, thread_messages)) == (1, 1)


@pytest.mark.parametrize(
    ("thread_id", "messages", "match"),
    [
        ("t", [msg("user", "ok"), "not an object"], "Message 1 is not a chat message"),
        ("t", {"role": "user"}, "Messages are a list of chat messages"),
        ("t", [{"x": float("nan")}], "Message 0 cannot be stored as JSON"),
        ("t", [{"x": object()}], "Message 0 cannot be stored as JSON"),
        ("", [msg("user", "x")], "A thread id is 1 to 64 characters"),
        ("x" * 65, [msg("user", "x")], "A thread id is 1 to 64 characters"),
        ("a\nb", [msg("user", "x")], "cannot contain control characters"),
    ],
)
async def test_a_turn_that_is_not_a_list_of_json_objects_or_has_a_bad_thread_id_is_refused_and_stores_nothing(
    store, acme, thread_id, messages, match
):
    gateway, _ = acme
    with pytest.raises(StoreError, match=match):
        await store.append_thread(gateway, thread_id, messages, "tiny")
    assert (await count(store, threads), await count(store, thread_messages)) == (0, 0)


# -- stored responses ----------------------------------------------------------------------


async def test_a_response_chain_is_replayed_oldest_first_and_a_branch_from_an_older_response_leaves_out_the_other(
    store, acme
):
    gateway, _ = acme
    await store.store_response(gateway, "r1", None, [msg("user", "1"), msg("assistant", "one")])
    await store.store_response(gateway, "r2", "r1", [msg("user", "2"), msg("assistant", "two")])
    await store.store_response(gateway, "r3", "r2", [msg("user", "3"), msg("assistant", "three")])
    assert [m["content"] for m in await store.response_history(gateway, "r3", 24)] == [
        "1",
        "one",
        "2",
        "two",
        "3",
        "three",
    ]
    # A branch from r1: r2 and r3 are not part of it.
    await store.store_response(gateway, "r2b", "r1", [msg("user", "2b"), msg("assistant", "two-b")])
    assert [m["content"] for m in await store.response_history(gateway, "r2b", 24)] == ["1", "one", "2b", "two-b"]
    assert [m["content"] for m in await store.response_history(gateway, "r1", 24)] == ["1", "one"]
    assert len(await store.response_history(gateway, "r3", 24)) == 6


async def test_a_response_is_private_to_its_project_and_its_window_and_ids_are_never_reused(store, acme):
    gateway, billing = acme
    await store.store_response(gateway, "r1", None, [msg("user", "1")])
    assert await store.response_history(billing, "r1", 24) is None
    assert await store.response_history(gateway, "nothing", 24) is None
    with pytest.raises(NotFound, match="no stored response r1 to continue"):
        await store.store_response(billing, "r2", "r1", [msg("user", "2")])
    with pytest.raises(StoreError, match="A response with the id r1 is stored already"):
        await store.store_response(billing, "r1", None, [msg("user", "again")])
    assert await count(store, stored_responses) == 1

    await age(store, stored_responses, "last_turn_at", 25, id="r1")
    assert await store.response_history(gateway, "r1", 24) is None
    assert await store.response_history(gateway, "r1", 26) == [msg("user", "1")]


async def test_continuing_a_chain_keeps_its_older_responses_as_long_as_its_newest(store, acme):
    gateway, _ = acme
    await store.set_retention("gateway", "threads", 24)
    await store.store_response(gateway, "r1", None, [msg("user", "1")])
    await store.store_response(gateway, "r2", "r1", [msg("user", "2")])
    await age(store, stored_responses, "last_turn_at", 23)  # both nearly out of their window
    await store.store_response(gateway, "r3", "r2", [msg("user", "3")])
    await age(store, stored_responses, "created_at", 30)  # created long ago, used just now

    assert await store.sweep_agent_data() == Swept(0, 0, 0)
    assert [m["content"] for m in await store.response_history(gateway, "r3", 1)] == ["1", "2", "3"]


# -- notes -----------------------------------------------------------------------------------


async def test_notes_are_created_read_listed_last_written_first_updated_and_deleted(store, acme):
    gateway, _ = acme
    first = await store.create_note(gateway, "the deploy key lives in vault", title="  Deploys ")
    assert first.id.startswith("note_") and len(first.id) == 29 and first.title == "Deploys"
    second = await store.create_note(gateway, "standup is at ten")
    assert second.title is None
    assert await store.get_note(gateway, first.id, 24) == first
    assert [n.id for n in await store.list_notes(gateway, 24)] == [second.id, first.id]

    changed = await store.update_note(gateway, first.id, text="the deploy key moved to the HSM")
    assert changed.text == "the deploy key moved to the HSM" and changed.title == "Deploys"
    assert changed.updated_at >= changed.created_at == first.created_at
    assert [n.id for n in await store.list_notes(gateway, 24)] == [first.id, second.id]  # written last
    assert (await store.update_note(gateway, first.id, title="")).title is None  # an empty title removes it
    assert (await store.update_note(gateway, first.id, title="Keys")).text == "the deploy key moved to the HSM"
    assert [n.id for n in await store.list_notes(gateway, 24, limit=1, offset=1)] == [second.id]

    assert await store.delete_note(gateway, first.id) is True
    assert await store.get_note(gateway, first.id, 24) is None
    assert await store.delete_note(gateway, first.id) is False
    assert await store.update_note(gateway, first.id, text="back?") is None
    with pytest.raises(StoreError, match="Give the note's new text or title"):
        await store.update_note(gateway, second.id)


async def test_a_note_past_its_window_is_gone_for_reads_lists_searches_and_updates(store, acme):
    gateway, _ = acme
    old = await store.create_note(gateway, "forgotten words")
    await age(store, memory_notes, "updated_at", 25, id=old.id)
    assert await store.get_note(gateway, old.id, 24) is None
    assert await store.list_notes(gateway, 24) == []
    assert await store.search_notes(gateway, "forgotten", 24) == []
    assert await store.update_note(gateway, old.id, text="revived", retain_hours=24) is None
    assert (await store.get_note(gateway, old.id, 26)).text == "forgotten words"


@pytest.mark.parametrize(
    ("text_", "title", "match"),
    [
        ("", None, "A note needs text"),
        ("   \n", None, "A note needs text"),
        (None, None, "A note needs text"),
        ("é" * (MAX_NOTE_BYTES // 2 + 1), None, r"at most 64 KiB; this one is 65,538 bytes"),
        ("ok", "t" * 201, "A note's title is at most 200 characters; this one has 201"),
        ("nul \x00 inside", None, "cannot contain NUL characters"),
        ("ok", 5, "A note's title is text"),
    ],
)
async def test_a_note_without_text_or_too_long_is_refused_and_nothing_is_kept(store, acme, text_, title, match):
    gateway, _ = acme
    with pytest.raises(StoreError, match=match):
        await store.create_note(gateway, text_, title=title)
    assert await count(store, memory_notes) == 0


async def test_a_note_of_exactly_64_kib_is_kept_whole(store, acme):
    gateway, _ = acme
    note = await store.create_note(gateway, "é" * (MAX_NOTE_BYTES // 2))
    assert (await store.get_note(gateway, note.id, 1)).text == note.text


async def test_note_search_needs_every_word_in_the_title_or_text_and_ignores_case(store, acme):
    gateway, _ = acme
    vault = await store.create_note(gateway, "The deploy key lives in Vault", title="Deploys")
    standup = await store.create_note(gateway, "Standup is at ten, in the small room", title="Meetings")
    assert [n.id for n in await store.search_notes(gateway, "vault", 24)] == [vault.id]
    assert [n.id for n in await store.search_notes(gateway, "DEPLOYS", 24)] == [vault.id]  # the title
    assert [n.id for n in await store.search_notes(gateway, "meetings ten", 24)] == [standup.id]  # title and text
    assert await store.search_notes(gateway, "vault ten", 24) == []  # every word must be there
    assert {n.id for n in await store.search_notes(gateway, "the in", 24)} == {vault.id, standup.id}
    assert await store.search_notes(gateway, "vau", 24) == []  # words, not parts of them
    assert await store.search_notes(gateway, "   ", 24) == []


async def test_note_search_ranks_the_better_match_first(store, acme):
    gateway, _ = acme
    once = await store.create_note(gateway, "kafka mentioned once among many other words here and there")
    often = await store.create_note(gateway, "kafka kafka kafka")
    assert [n.id for n in await store.search_notes(gateway, "kafka", 24)] == [often.id, once.id]
    assert [n.id for n in await store.search_notes(gateway, "kafka", 24, limit=1)] == [often.id]


@pytest.mark.parametrize(
    "query", ['foo"bar (x', "foo AND (bar OR", "NEAR(foo bar)", "foo* ^bar -x", "x:foo", "'; DROP TABLE x; --", '"']
)
async def test_note_search_takes_punctuation_and_operators_as_text_never_as_query_syntax(store, acme, query):
    gateway, _ = acme
    await store.create_note(gateway, "foo bar x")
    found = await store.search_notes(gateway, query, 24)  # never an error
    assert isinstance(found, list)


async def test_note_search_matches_the_words_of_a_query_full_of_punctuation(store, acme):
    gateway, _ = acme
    note = await store.create_note(gateway, 'They said foo"bar, then (x).')
    other = await store.create_note(gateway, "foo alone")
    assert [n.id for n in await store.search_notes(gateway, 'foo"bar (x', 24)] == [note.id]
    assert [n.id for n in await store.search_notes(gateway, "(foo)", 24)] != []
    assert {n.id for n in await store.search_notes(gateway, "foo!", 24)} == {note.id, other.id}
    assert await store.search_notes(gateway, "( ) --", 24) == []  # no word in it


async def test_note_search_follows_updates_and_deletes(store, acme):
    gateway, _ = acme
    note = await store.create_note(gateway, "alpha words", title="first")
    await store.update_note(gateway, note.id, text="beta words")
    assert await store.search_notes(gateway, "alpha", 24) == []
    assert [n.text for n in await store.search_notes(gateway, "beta", 24)] == ["beta words"]
    await store.update_note(gateway, note.id, title="renamed")
    assert await store.search_notes(gateway, "first", 24) == []
    assert [n.id for n in await store.search_notes(gateway, "renamed beta", 24)] == [note.id]
    await store.delete_note(gateway, note.id)
    assert await store.search_notes(gateway, "beta", 24) == []
    again = await store.create_note(gateway, "beta again")  # the index holds nothing stale
    assert [n.id for n in await store.search_notes(gateway, "beta", 24)] == [again.id]


async def test_note_search_stays_in_its_project(store, acme):
    gateway, billing = acme
    await store.create_note(billing, "invoice numbering rules")
    mine = await store.create_note(gateway, "invoice links go to billing")
    assert [n.id for n in await store.search_notes(gateway, "invoice", 24)] == [mine.id]


# -- the sweep -------------------------------------------------------------------------------


async def test_the_sweep_removes_what_expired_or_was_turned_off_keeps_the_rest_and_counts_it(store, acme):
    gateway, billing = acme
    await store.add_project("search", "Acme/platform")
    search = (await store.find("project", "search")).id
    await store.set_retention("gateway", "threads", 24)
    await store.set_retention("gateway", "memory", 24)
    await store.set_retention("billing", "threads", 24)
    await store.set_retention("search", "memory", 48)

    for pid, tid in ((gateway, "fresh"), (gateway, "old"), (billing, "b"), (None, "pool-fresh"), (None, "pool-old")):
        await store.append_thread(pid, tid, [msg("user", tid), msg("assistant", "ok")], "tiny")
    await age(store, threads, "last_turn_at", 30, thread_id="old")
    await age(store, threads, "last_turn_at", 30, thread_id="pool-old")
    await store.store_response(gateway, "resp-fresh", None, [msg("user", "x")])
    await store.store_response(gateway, "resp-old", None, [msg("user", "x")])
    await age(store, stored_responses, "last_turn_at", 30, id="resp-old")
    await store.store_response(None, "resp-pool", None, [msg("user", "x")])
    kept_note = await store.create_note(gateway, "kept")
    old_note = await store.create_note(gateway, "old")
    await age(store, memory_notes, "updated_at", 30, id=old_note.id)
    search_note = await store.create_note(search, "within 48 hours")
    await age(store, memory_notes, "updated_at", 30, id=search_note.id)
    await store.create_note(billing, "billing keeps no notes")
    await store.create_note(None, "the pool keeps no notes here")
    # Billing turns conversations off: what it kept goes at this sweep.
    await store.set_retention("billing", "threads", None)

    swept = await store.sweep_agent_data(pool_threads_hours=24, pool_memory_hours=None)

    assert swept == Swept(threads=3, responses=1, notes=3)
    assert await store.thread_messages(gateway, "fresh", 1000) is not None
    assert await store.thread_messages(None, "pool-fresh", 1000) is not None
    for pid, tid in ((gateway, "old"), (billing, "b"), (None, "pool-old")):
        assert await store.thread_messages(pid, tid, 1000) is None
    assert await count(store, thread_messages) == 4  # the two threads kept, two messages each
    assert await store.response_history(gateway, "resp-fresh", 1000) is not None
    assert await store.response_history(None, "resp-pool", 1000) is not None
    assert await count(store, stored_responses) == 2
    assert {n.id for n in await store.list_notes(gateway, 1000)} == {kept_note.id}
    assert [n.id for n in await store.list_notes(search, 1000)] == [search_note.id]
    assert await store.list_notes(None, 1000) == [] and await store.list_notes(billing, 1000) == []
    assert await store.sweep_agent_data(pool_threads_hours=24) == Swept(0, 0, 0)

    # Without pool hours the pool keeps nothing.
    assert await store.sweep_agent_data() == Swept(threads=1, responses=1, notes=0)


async def test_the_sweep_refuses_pool_hours_that_are_no_window(store):
    with pytest.raises(StoreError, match="whole number of hours from 1"):
        await store.sweep_agent_data(pool_threads_hours=0)


# -- projects, migrations, moving the store ---------------------------------------------------


async def test_removing_a_project_removes_its_conversations_responses_notes_and_settings(store, acme):
    gateway, billing = acme
    for pid in (gateway, billing):
        await store.set_retention(pid, "threads", 24)
        await store.set_retention(pid, "memory", 24)
        await store.append_thread(pid, "t", [msg("user", "x")], "tiny")
        await store.store_response(pid, f"resp-{pid}", None, [msg("user", "x")])
        await store.create_note(pid, "searchable words")

    await store.remove("project", "Acme/platform/billing")

    assert [r.project_id for r in await store.retention_settings()] == [gateway]
    async with store.engine.connect() as conn:
        for table in (threads, stored_responses, memory_notes, project_retention):
            assert set(await conn.scalars(select(table.c.project_id))) == {gateway}, table.name
        assert await conn.scalar(select(func.count()).select_from(thread_messages)) == 1
    assert len(await store.search_notes(gateway, "searchable", 24)) == 1


async def test_the_migration_down_to_0009_drops_everything_it_made_and_up_again_works(address):
    async with await Store.open(address) as s:
        await s.create_note(None, "before the downgrade")
        async with s.engine.begin() as conn:
            await conn.run_sync(lambda c: command.downgrade(_alembic_config(c), "0009"))
            names = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
            assert not names & set(AGENT_TABLES) and not any("fts" in n for n in names)
            assert "rate_shares" in names
    async with await Store.open(address) as s:  # upgraded again on open
        note = await s.create_note(None, "after the upgrade")
        assert [n.id for n in await s.search_notes(None, "upgrade", 1)] == [note.id]


async def test_a_moved_store_keeps_its_conversations_and_its_notes_searchable(tmp_path, address):
    source = str(tmp_path / "source.db")
    async with await Store.open(source) as s:
        await s.add_org("Acme")
        await s.add_team("platform", "Acme")
        gateway = (await s.add_project("gateway", "Acme/platform")).id
        await s.set_retention("gateway", "memory", 24)
        await s.append_thread(gateway, "t", [msg("user", "hi"), msg("assistant", "hello")], "tiny")
        await s.store_response(gateway, "r1", None, [msg("user", "1")])
        await s.store_response(gateway, "r2", "r1", [msg("user", "2")])
        notes = [await s.create_note(gateway, f"note number {i} about kafka") for i in range(3)]
        await s.delete_note(gateway, notes[1].id)

    await move_store(source, address)

    async with await Store.open(address) as d:
        assert await d.thread_messages(gateway, "t", 24) == [msg("user", "hi"), msg("assistant", "hello")]
        assert [m["content"] for m in await d.response_history(gateway, "r2", 24)] == ["1", "2"]
        assert {n.id for n in await d.search_notes(gateway, "kafka", 24)} == {notes[0].id, notes[2].id}
        assert [r.memory_hours for r in await d.retention_settings()] == [24]
        # New rows after the copy: the keys go on past the copied ones.
        await d.append_thread(gateway, "t2", [msg("user", "new")], "tiny")
        fresh = await d.create_note(gateway, "kafka after the move")
        assert fresh.id in {n.id for n in await d.search_notes(gateway, "kafka", 24)}


async def test_sqlite_keeps_the_note_search_in_step_through_its_three_triggers(tmp_path):
    async with await Store.open(str(tmp_path / "s.db")) as s, s.engine.connect() as conn:
        triggers = set(await conn.scalars(text("SELECT name FROM sqlite_master WHERE type = 'trigger'")))
    assert {"memory_notes_fts_ai", "memory_notes_fts_ad", "memory_notes_fts_au"} <= triggers


# -- the storage quota ----------------------------------------------------------------------


async def test_the_quota_counts_notes_threads_and_responses_by_utf8_bytes_and_uncounts_what_is_deleted(store, acme):
    gateway, billing = acme
    n = await store.create_note(gateway, "héllo", "t")  # 6 + 1 bytes
    await store.append_thread(gateway, "th", [msg("user", "a")], "tiny")
    await store.append_thread(gateway, "th", [msg("user", "b")], "tiny")  # the same thread: no new item
    await store.store_response(gateway, "resp_1", None, [msg("user", "c")])
    one = len(b'{"role":"user","content":"a"}')  # a thread's message, as JSON
    resp = one + 2  # a response's messages: a JSON list of one
    assert await store.agent_storage_used(gateway) == (3, 7 + 2 * one + resp)
    assert await store.agent_storage_used(billing) == (0, 0)
    await store.update_note(gateway, n.id, text="hé")  # 3 bytes now
    assert await store.agent_storage_used(gateway) == (3, 4 + 2 * one + resp)
    assert await store.delete_note(gateway, n.id) is True
    assert await store.delete_thread(gateway, "th") is True
    assert await store.agent_storage_used(gateway) == (1, resp)
    await store.set_retention("Acme/platform/gateway", "threads", None)
    await store.sweep_agent_data()  # the project keeps no conversations now: its response goes
    assert await store.agent_storage_used(gateway) == (0, 0)


async def test_a_write_past_the_items_quota_is_refused_naming_it_and_writes_nothing(store, acme):
    gateway, _ = acme
    quota = Quota(items=2, bytes=10_000)
    await store.create_note(gateway, "one", quota=quota)
    await store.append_thread(gateway, "th", [msg("user", "a")], "tiny", quota)
    with pytest.raises(QuotaFull) as e:
        await store.create_note(gateway, "three", quota=quota)
    assert e.value.status == 429 and e.value.code == "storage_quota_items"
    assert "keeps 2 of its 2 conversations, stored responses and notes (agents.quota_items)" in str(e.value)
    assert "DELETE /v1/memory/ID" in str(e.value)
    with pytest.raises(QuotaFull):
        await store.store_response(gateway, "resp_1", None, [msg("user", "x")], quota)
    with pytest.raises(QuotaFull):
        await store.append_thread(gateway, "th2", [msg("user", "x")], "tiny", quota)
    await store.append_thread(gateway, "th", [msg("user", "more")], "tiny", quota)  # an existing thread grows
    assert (await count(store, memory_notes), await count(store, stored_responses), await count(store, threads)) == (
        1,
        0,
        1,
    )
    assert (await store.agent_storage_used(gateway))[0] == 2


async def test_a_write_past_the_bytes_quota_is_refused_429_and_one_larger_than_the_whole_quota_413(store, acme):
    gateway, _ = acme
    quota = Quota(items=100, bytes=10)
    n = await store.create_note(gateway, "12345678", quota=quota)
    with pytest.raises(QuotaFull) as e:
        await store.create_note(gateway, "abc", quota=quota)
    assert e.value.status == 429 and e.value.code == "storage_quota_bytes"
    assert "keeps 8 of its 10 bytes and this needs 3 more (agents.quota_bytes)" in str(e.value)
    with pytest.raises(QuotaFull) as big:
        await store.create_note(gateway, "x" * 11, quota=quota)
    assert big.value.status == 413 and "more than the whole storage quota" in str(big.value)
    with pytest.raises(QuotaFull):
        await store.update_note(gateway, n.id, text="12345678901", quota=quota)  # grown past it
    assert (await store.get_note(gateway, n.id, 24)).text == "12345678"
    await store.update_note(gateway, n.id, text="1", quota=quota)  # shrinking always goes
    assert await store.agent_storage_used(gateway) == (1, 1)


async def test_concurrent_writes_from_two_stores_on_one_database_never_pass_the_items_quota(address, acme):
    gateway, _ = acme
    quota = Quota(items=5, bytes=10**6)
    stores = [await Store.open(address) for _ in range(2)]
    try:
        results = await asyncio.gather(
            *(stores[i % 2].create_note(gateway, f"note {i}", quota=quota) for i in range(20)), return_exceptions=True
        )
    finally:
        for s in stores:
            await s.close()
    kept = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, QuotaFull)]
    assert len(kept) == 5 and len(refused) == 15, results
