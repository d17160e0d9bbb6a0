"""What agents keep in the store, mixed into Store: conversations (threads: the gateway
replays a thread's messages so a client sends only its new turn), stored Responses-API
responses (chains linked by previous_id) and memory notes (searchable, full text).

Nothing is kept unless a project turned it on (set_retention), and then only for its
window: a thread for threads_hours after its last turn, a response chain for threads_hours
after the last response that continued it, a note for memory_hours after it was last
written. Reads treat what is past its window as gone before the hourly sweep
(sweep_agent_data) removes it. project_id None is the shared pool of a gateway without
authentication, whose windows come from its configuration.

The project is part of every lookup: another project's thread, response or note reads
exactly as one that does not exist.

Note search is the one query written twice: SQLite matches an FTS5 table kept in step by
triggers (0010), PostgreSQL a GIN index over the notes' tsvector ('simple': no stemming,
notes may be in any language). Both take each word of the query as a phrase of its tokens,
and need every word.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import (
    ColumnClause,
    ColumnElement,
    LargeBinary,
    and_,
    cast,
    column,
    delete,
    func,
    literal_column,
    select,
    table,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Row
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .errors import NotFound, QuotaFull, StoreError
from .records import utcnow
from .schema import (
    BUMP_GENERATION,
    NOTES_SEARCH,
    agent_storage,
    memory_notes,
    project_retention,
    stored_responses,
    thread_messages,
    threads,
)
from .tenancy import _find, _load_tree

KINDS = ("threads", "memory")
MAX_HOURS = 87_600  # ten years: far inside what datetime arithmetic takes
MAX_CALLER_ID = 64  # thread and response ids
MAX_NOTE_BYTES = 64 * 1024
MAX_TITLE = 200
MAX_CHAIN = 1000  # responses followed back from one; a longer chain is cut to its newest
MAX_PAGE = 1000
_DELETE_BATCH = 500  # ids per statement: SQLite caps the parameters of one

_WHAT = {"threads": "conversations", "memory": "notes"}
_NOTE_COLS = (
    memory_notes.c.id,
    memory_notes.c.title,
    memory_notes.c.text,
    memory_notes.c.created_at,
    memory_notes.c.updated_at,
)
# The FTS5 table, for queries only (the migration makes it; it is not part of the schema).
_fts = table(NOTES_SEARCH, column("rowid"))
_FTS: ColumnClause[Any] = literal_column(NOTES_SEARCH)
# Exactly the indexed expression (0010), which is what lets PostgreSQL use the index.
PG_NOTE_VECTOR: ColumnClause[Any] = literal_column(
    "to_tsvector('simple', coalesce(memory_notes.title, '') || ' ' || memory_notes.text)"
)
_PG_SIMPLE: ColumnClause[Any] = literal_column("'simple'")


@dataclass(frozen=True, slots=True)
class Retention:
    """A project's settings: how many hours conversations and notes are kept; None: off."""

    project_id: str
    project_path: str
    threads_hours: int | None
    memory_hours: int | None


@dataclass(frozen=True, slots=True)
class Note:
    id: str  # note_ + 24 hex
    title: str | None
    text: str
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class Swept:
    """What one sweep removed."""

    threads: int
    responses: int
    notes: int


@dataclass(frozen=True, slots=True)
class Quota:
    """What one project may keep (server.yaml agents.quota_items, agents.quota_bytes)."""

    items: int
    bytes: int


# -- quotas ---------------------------------------------------------------------------------
#
# Each project's items and bytes are counted in its agent_storage row. Every write and every
# delete locks that row first (_kept: an INSERT ... ON CONFLICT DO UPDATE, which on PostgreSQL
# holds the row until the commit; SQLite's writes are serialized anyway), then checks, writes and
# counts in the same transaction: two writes at once, in any processes or gateways, are counted
# one after the other, and a refused write leaves nothing behind. Locking the counter before any
# row of the kept data is the one order every transaction takes, so none waits on another in a
# circle.


def _octets(conn: AsyncConnection, col: Any) -> Any:
    """The column's size as UTF-8 bytes, as Python's len(text.encode()) counts it (0 for null)."""
    if conn.dialect.name == "postgresql":
        return func.coalesce(func.octet_length(col), 0)
    return func.coalesce(func.length(cast(col, LargeBinary)), 0)


def _utf8(*texts: str | None) -> int:
    return sum(len(t.encode("utf-8")) for t in texts if t)


async def _kept(conn: AsyncConnection, project_id: str | None) -> tuple[int, int]:
    """Lock the project's counter row (made when it has none) and read (items, bytes)."""
    ins = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(agent_storage)
    row = (
        await conn.execute(
            ins.values(scope=project_id or "", item_count=0, byte_count=0)
            .on_conflict_do_update(
                index_elements=[agent_storage.c.scope], set_={"item_count": agent_storage.c.item_count}
            )
            .returning(agent_storage.c.item_count, agent_storage.c.byte_count)
        )
    ).one()
    return int(row.item_count), int(row.byte_count)


async def _take(conn: AsyncConnection, project_id: str | None, items: int, size: int, quota: Quota | None) -> None:
    """Count a write of `items` more items and `size` more bytes, or refuse it (QuotaFull) when the
    quota has no room; locks the counter row first."""
    used_items, used_bytes = await _kept(conn, project_id)
    if quota is not None:
        where = f"project {project_id}" if project_id else "the shared pool"
        free = (
            "; delete what is no longer needed (DELETE /v1/memory/ID, DELETE /v1/threads/ID) or wait until "
            "older ones expire"
        )
        if size > quota.bytes:
            raise QuotaFull(
                f"this is {size:,} bytes to keep, more than the whole storage quota of {where} "
                f"({quota.bytes:,} bytes, agents.quota_bytes); keep less at once",
                413,
                "storage_quota_bytes",
            )
        if items > 0 and used_items + items > quota.items:
            raise QuotaFull(
                f"the storage quota of {where} is full: it keeps {used_items:,} of its {quota.items:,} "
                f"conversations, stored responses and notes (agents.quota_items){free}",
                429,
                "storage_quota_items",
            )
        if size > 0 and used_bytes + size > quota.bytes:
            raise QuotaFull(
                f"the storage quota of {where} is full: it keeps {used_bytes:,} of its {quota.bytes:,} bytes "
                f"and this needs {size:,} more (agents.quota_bytes){free}",
                429,
                "storage_quota_bytes",
            )
    if items or size:
        await _count(conn, project_id, items, size)


async def _count(conn: AsyncConnection, project_id: str | None, items: int, size: int) -> None:
    s = agent_storage
    await conn.execute(
        update(s)
        .where(s.c.scope == (project_id or ""))
        .values(item_count=s.c.item_count + items, byte_count=s.c.byte_count + size)
    )


async def _give_back(conn: AsyncConnection, gone: list[tuple[str | None, int, int]]) -> None:
    """Uncount what was deleted: (project, items, bytes) rows, summed per project."""
    by_scope: dict[str | None, list[int]] = {}
    for project_id, items, size in gone:
        acc = by_scope.setdefault(project_id, [0, 0])
        acc[0] += items
        acc[1] += int(size or 0)
    for project_id, (items, size) in by_scope.items():
        if items or size:
            await _count(conn, project_id, -items, -size)


# -- checks -------------------------------------------------------------------------------


def _check_hours(what: str, hours: object, *, off_allowed: bool) -> int | None:
    if hours is None and off_allowed:
        return None
    if isinstance(hours, bool) or not isinstance(hours, int) or not 1 <= hours <= MAX_HOURS:
        off = f"; to keep no {what}, turn them off instead" if off_allowed else ""
        raise StoreError(
            f"How long {what} are kept is a whole number of hours from 1 to {MAX_HOURS:,}, not {hours!r}{off}."
        )
    return hours


def _window(retain_hours: object) -> datetime:
    """The oldest time still inside a window of retain_hours."""
    if isinstance(retain_hours, bool) or not isinstance(retain_hours, int) or not 1 <= retain_hours <= MAX_HOURS:
        raise StoreError(f"retain_hours is a whole number of hours from 1 to {MAX_HOURS:,}, not {retain_hours!r}.")
    return utcnow() - timedelta(hours=retain_hours)


def _check_project(project_id: object) -> str | None:
    if project_id is not None and (not isinstance(project_id, str) or not project_id):
        raise StoreError(f"A project id is the project's id (proj-…), or None for the shared pool; not {project_id!r}.")
    return project_id


def caller_id_problem(what: str, value: object) -> str | None:
    """Why ``value`` cannot be a thread, response or note id, or None when it can be one.

    The one rule for ids a caller hands in, which the gateway checks before it asks the store:
    1 to 64 characters, none of them a control character (PostgreSQL refuses NUL in text) or
    a lone surrogate (no UTF-8 encodes one)."""
    if not isinstance(value, str) or not value or len(value) > MAX_CALLER_ID:
        shown = (
            f"{value[:MAX_CALLER_ID]!r}… ({len(value)} characters)" if isinstance(value, str) and value else repr(value)
        )
        return f"A {what} id is 1 to {MAX_CALLER_ID} characters, not {shown}."
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value):
        return f"A {what} id cannot contain control characters: {value!r}."
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"A {what} id cannot contain a lone surrogate (it is not text): {value!r}."
    return None


def _check_caller_id(what: str, value: object) -> str:
    problem = caller_id_problem(what, value)
    if problem is not None:
        raise StoreError(problem)
    assert isinstance(value, str)
    return value


def _check_page(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (name == "limit" and value > MAX_PAGE):
        upper = f" to {MAX_PAGE}" if name == "limit" else " or more"
        raise StoreError(f"The {name} is a whole number from {low}{upper}, not {value!r}.")
    return value


def _utf8_len(what: str, value: str) -> int:
    if "\x00" in value:
        raise StoreError(f"A note's {what} cannot contain NUL characters.")
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise StoreError(f"A note's {what} is not valid text (it holds a lone surrogate).") from None


def _check_text(text: object) -> str:
    if not isinstance(text, str) or not text.strip():
        raise StoreError("A note needs text: give what to keep.")
    size = _utf8_len("text", text)
    if size > MAX_NOTE_BYTES:
        raise StoreError(f"A note's text is at most {MAX_NOTE_BYTES // 1024} KiB; this one is {size:,} bytes.")
    return text


def _check_title(title: object) -> str | None:
    """A title, or None for none (an empty title is none)."""
    if title is None:
        return None
    if not isinstance(title, str):
        raise StoreError(f"A note's title is text, not {title!r}.")
    title = title.strip()
    _utf8_len("title", title)
    if len(title) > MAX_TITLE:
        raise StoreError(f"A note's title is at most {MAX_TITLE} characters; this one has {len(title)}.")
    return title or None


def _json_text(value: object, what: str) -> str:
    try:
        out = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise StoreError(f"{what} cannot be stored as JSON: {e}.") from None
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate cannot be UTF-8 text; escaped, it survives the round trip.
        out = json.dumps(value, allow_nan=False, separators=(",", ":"))
    return out


def _check_messages(messages: object) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise StoreError("Messages are a list of chat messages (JSON objects).")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise StoreError(f"Message {i} is not a chat message (a JSON object); it is {type(m).__name__}.")
    return list(messages)


def _words(query: str) -> list[str]:
    """The query's words (split at white space) that hold something to match; a word of
    punctuation alone has no token on either side."""
    return [w for w in query.split() if any(c.isalnum() for c in w)]


# -- query pieces -------------------------------------------------------------------------


def _scope(col: Any, project_id: str | None) -> ColumnElement[bool]:
    # Spelled out rather than IS NOT DISTINCT FROM, which PostgreSQL cannot answer from an index.
    return col.is_(None) if project_id is None else col == project_id  # type: ignore[no-any-return]


def _thread(project_id: str | None, thread_id: str) -> ColumnElement[bool]:
    return and_(_scope(threads.c.project_id, project_id), threads.c.thread_id == thread_id)


def _note(row: Row[Any] | Any) -> Note:
    return Note(row.id, row.title, row.text, row.created_at, row.updated_at)


def _chain(project_id: str | None, response_id: str, since: datetime | None) -> Any:
    """The chain of responses ending at response_id, as a recursive CTE of (id, messages,
    depth), depth 0 the newest; each step stays in the project (and, given since, the window)."""
    r = stored_responses
    prev = r.alias("prev")
    base = select(r.c.id, r.c.previous_id, r.c.messages, literal_column("0").label("depth")).where(
        r.c.id == response_id, _scope(r.c.project_id, project_id)
    )
    if since is not None:
        base = base.where(r.c.last_turn_at >= since)
    chain = base.cte("chain", recursive=True)
    step = (
        select(prev.c.id, prev.c.previous_id, prev.c.messages, chain.c.depth + literal_column("1"))
        .join(chain, prev.c.id == chain.c.previous_id)
        .where(_scope(prev.c.project_id, project_id), chain.c.depth < MAX_CHAIN - 1)
    )
    if since is not None:
        step = step.where(prev.c.last_turn_at >= since)
    return chain.union_all(step)


async def _delete_threads(conn: AsyncConnection, where: ColumnElement[bool]) -> int:
    """Delete the threads matching where, and their messages (SQLite does not enforce the
    foreign key's cascade), uncounted from their projects' storage (whose rows the caller has
    locked, so no turn joins a thread between the choice and the delete); returns how many
    threads. The messages go first: PostgreSQL's cascade would otherwise take them unseen."""
    gone = {r.id: r.project_id for r in await conn.execute(select(threads.c.id, threads.c.project_id).where(where))}
    ids = list(gone)
    counted: list[tuple[str | None, int, int]] = [(p, 1, 0) for p in gone.values()]
    m = thread_messages
    for i in range(0, len(ids), _DELETE_BATCH):
        batch = ids[i : i + _DELETE_BATCH]
        sizes = await conn.execute(
            delete(m).where(m.c.thread.in_(batch)).returning(m.c.thread, _octets(conn, m.c.message))
        )
        counted += [(gone[thread], 0, size) for thread, size in sizes]
        await conn.execute(delete(threads).where(threads.c.id.in_(batch)))
    await _give_back(conn, counted)
    return len(gone)


def _expired(
    t: Any, at: Any, hours: dict[str, int], pool_hours: int | None, now: datetime
) -> list[ColumnElement[bool]]:
    """Conditions for the rows of t past their window by the time column at: a project's
    rows when it has none (off, or no longer a project), or when older than its hours; the
    pool's likewise by pool_hours. One condition per distinct window, not per project."""
    pid = t.c.project_id
    out: list[ColumnElement[bool]] = [and_(pid.is_not(None), pid.not_in(list(hours)))]
    by_hours: dict[int, list[str]] = {}
    for project_id, h in hours.items():
        by_hours.setdefault(h, []).append(project_id)
    out += [and_(pid.in_(ps), at < now - timedelta(hours=h)) for h, ps in sorted(by_hours.items())]
    out.append(pid.is_(None) if pool_hours is None else and_(pid.is_(None), at < now - timedelta(hours=pool_hours)))
    return out


class AgentDataMixin:
    """Store methods for retention settings, threads, stored responses and notes."""

    _engine: AsyncEngine
    _writer: AsyncEngine

    # -- settings ------------------------------------------------------------------------

    async def set_retention(
        self, project_path: str, kind: Literal["threads", "memory"], hours: int | None
    ) -> Retention:
        """Keep a project's conversations ("threads") or notes ("memory") for hours (threads:
        after the last turn; notes: after they were last written), or stop keeping them (None):
        nothing new is stored, and what is kept goes at the next sweep. project_path is the
        project's path, id or unique name. Bumps the keys generation, so gateways reload."""
        if kind not in KINDS:
            raise StoreError(f'The kind is "threads" (conversations) or "memory" (notes), not {kind!r}.')
        hours = _check_hours(_WHAT[kind], hours, off_allowed=True)
        column_ = f"{kind}_hours"
        now = utcnow()
        async with self._writer.begin() as conn:
            proj = _find(await _load_tree(conn), "project", project_path)
            # One statement that writes only this kind's hours, so a concurrent change to the
            # other kind is not undone.
            ins = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(project_retention)
            await conn.execute(
                ins.values(project_id=proj.id, updated_at=now, **{column_: hours}).on_conflict_do_update(
                    index_elements=[project_retention.c.project_id], set_={column_: hours, "updated_at": now}
                )
            )
            row = (await conn.execute(select(project_retention).where(project_retention.c.project_id == proj.id))).one()
            if row.threads_hours is None and row.memory_hours is None:
                await conn.execute(delete(project_retention).where(project_retention.c.project_id == proj.id))
            await conn.execute(BUMP_GENERATION)
        return Retention(proj.id, proj.path, row.threads_hours, row.memory_hours)

    async def retention_settings(self) -> list[Retention]:
        """Every project with either setting on, by path."""
        async with self._engine.connect() as conn:
            tree = await _load_tree(conn)
            rows = await conn.execute(select(project_retention))
            found = [
                Retention(r.project_id, tree.projects[r.project_id].path, r.threads_hours, r.memory_hours)
                for r in rows
                if r.project_id in tree.projects  # SQLite may hold a removed project's row from before 0010's cleanup
            ]
        return sorted(found, key=lambda r: r.project_path)

    # -- threads -------------------------------------------------------------------------

    async def thread_messages(
        self, project_id: str | None, thread_id: str, retain_hours: int
    ) -> list[dict[str, Any]] | None:
        """The thread's messages in order; None when the project has no such thread, or its
        last turn is older than retain_hours. An expired thread is deleted here and then, so
        a new turn under its id starts afresh instead of joining what expired."""
        project_id = _check_project(project_id)
        thread_id = _check_caller_id("thread", thread_id)
        since = _window(retain_hours)
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(select(threads.c.id, threads.c.last_turn_at).where(_thread(project_id, thread_id)))
            ).first()
            if row is None:
                return None
            if row.last_turn_at >= since:
                q = select(thread_messages.c.message).where(thread_messages.c.thread == row.id)
                return [json.loads(m) for m in await conn.scalars(q.order_by(thread_messages.c.seq))]
        async with self._writer.begin() as conn:
            await _kept(conn, project_id)
            # Only if still expired: a turn may have come in since.
            await _delete_threads(conn, and_(threads.c.id == row.id, threads.c.last_turn_at < since))
        return None

    async def append_thread(
        self,
        project_id: str | None,
        thread_id: str,
        messages: list[dict[str, Any]],
        model: str,
        quota: Quota | None = None,
    ) -> None:
        """Add messages to the end of the thread (created by its first append), in one
        transaction; its last turn is now, by model. Refused (QuotaFull), writing nothing, when
        the project's quota has no room for a new thread or the messages' bytes."""
        project_id = _check_project(project_id)
        thread_id = _check_caller_id("thread", thread_id)
        rows = [_json_text(m, f"Message {i}") for i, m in enumerate(_check_messages(messages))]
        if not isinstance(model, str):
            raise StoreError(f"The model of a turn is its name, not {model!r}.")
        now = utcnow()
        async with self._writer.begin() as conn:
            await _kept(conn, project_id)  # locked before it is asked whether the thread is new
            new_thread = await conn.scalar(select(threads.c.id).where(_thread(project_id, thread_id))) is None
            await _take(conn, project_id, int(new_thread), _utf8(*rows), quota)
            ref = await _touch_thread(conn, project_id, thread_id, now, model)
            last = await conn.scalar(
                select(func.coalesce(func.max(thread_messages.c.seq), 0)).where(thread_messages.c.thread == ref)
            )
            if rows:
                await conn.execute(
                    thread_messages.insert(),
                    [{"thread": ref, "seq": int(last or 0) + 1 + i, "message": m} for i, m in enumerate(rows)],
                )

    async def delete_thread(self, project_id: str | None, thread_id: str) -> bool:
        """Forget a thread and its messages now; False when the project has no such thread."""
        project_id = _check_project(project_id)
        thread_id = _check_caller_id("thread", thread_id)
        async with self._writer.begin() as conn:
            await _kept(conn, project_id)
            return await _delete_threads(conn, _thread(project_id, thread_id)) == 1

    # -- stored responses ----------------------------------------------------------------

    async def store_response(
        self,
        project_id: str | None,
        response_id: str,
        previous_id: str | None,
        messages: list[dict[str, Any]],
        quota: Quota | None = None,
    ) -> None:
        """Keep one response's turn (its input and reply, as chat messages). previous_id, when
        given, must be a response stored in the same project: the chain it continues, which is
        then kept as long as this one. Refused (QuotaFull), writing nothing, past the quota."""
        project_id = _check_project(project_id)
        response_id = _check_caller_id("response", response_id)
        if previous_id is not None:
            previous_id = _check_caller_id("response", previous_id)
        payload = _json_text(_check_messages(messages), "The messages")
        now = utcnow()
        r = stored_responses
        async with self._writer.begin() as conn:
            await _take(conn, project_id, 1, _utf8(payload), quota)
            if await conn.scalar(select(r.c.id).where(r.c.id == response_id)) is not None:
                raise StoreError(
                    f"A response with the id {response_id} is stored already; give each response its own id."
                )
            if previous_id is not None:
                found = await conn.scalar(
                    select(r.c.id).where(r.c.id == previous_id, _scope(r.c.project_id, project_id))
                )
                if found is None:
                    raise NotFound(f"There is no stored response {previous_id} to continue (it expired or never was).")
                chain = _chain(project_id, previous_id, None)
                await conn.execute(update(r).where(r.c.id.in_(select(chain.c.id))).values(last_turn_at=now))
            try:
                await conn.execute(
                    r.insert().values(
                        id=response_id,
                        project_id=project_id,
                        previous_id=previous_id,
                        messages=payload,
                        created_at=now,
                        last_turn_at=now,
                    )
                )
            except IntegrityError:
                raise StoreError(
                    f"A response with the id {response_id} was just stored; give each response its own id."
                ) from None

    async def response_history(
        self, project_id: str | None, response_id: str, retain_hours: int
    ) -> list[dict[str, Any]] | None:
        """Every message of the chain ending at response_id, oldest first (at most the
        newest MAX_CHAIN responses); None when the project has no such response, or it is
        past retain_hours (since it or a response continuing it was stored)."""
        project_id = _check_project(project_id)
        response_id = _check_caller_id("response", response_id)
        since = _window(retain_hours)
        chain = _chain(project_id, response_id, since)
        async with self._engine.connect() as conn:
            parts = list(await conn.scalars(select(chain.c.messages).order_by(chain.c.depth.desc())))
        if not parts:
            return None
        return [m for part in parts for m in json.loads(part)]

    # -- notes ---------------------------------------------------------------------------

    async def create_note(
        self, project_id: str | None, text: str, title: str | None = None, quota: Quota | None = None
    ) -> Note:
        """A new note; refused (QuotaFull), writing nothing, past the project's quota."""
        project_id = _check_project(project_id)
        text = _check_text(text)
        title = _check_title(title)
        now = utcnow()
        note = Note("note_" + secrets.token_hex(12), title, text, now, now)
        async with self._writer.begin() as conn:
            await _take(conn, project_id, 1, _utf8(text, title), quota)
            await conn.execute(
                memory_notes.insert().values(
                    id=note.id, project_id=project_id, title=title, text=text, created_at=now, updated_at=now
                )
            )
        return note

    async def get_note(self, project_id: str | None, note_id: str, retain_hours: int) -> Note | None:
        """The note; None when the project has none by that id, or it was last written more
        than retain_hours ago."""
        project_id = _check_project(project_id)
        since = _window(retain_hours)
        if caller_id_problem("note", note_id) is not None:
            return None  # no note has such an id, and PostgreSQL would refuse to look (NUL)
        q = select(*_NOTE_COLS).where(
            memory_notes.c.id == note_id,
            _scope(memory_notes.c.project_id, project_id),
            memory_notes.c.updated_at >= since,
        )
        async with self._engine.connect() as conn:
            row = (await conn.execute(q)).first()
        return _note(row) if row else None

    async def list_notes(
        self, project_id: str | None, retain_hours: int, limit: int = 50, offset: int = 0
    ) -> list[Note]:
        """The project's notes, the last written first."""
        project_id = _check_project(project_id)
        since = _window(retain_hours)
        limit, offset = _check_page("limit", limit, 1), _check_page("offset", offset, 0)
        q = (
            select(*_NOTE_COLS)
            .where(_scope(memory_notes.c.project_id, project_id), memory_notes.c.updated_at >= since)
            .order_by(memory_notes.c.updated_at.desc(), memory_notes.c.seq.desc())
            .limit(limit)
            .offset(offset)
        )
        async with self._engine.connect() as conn:
            return [_note(r) for r in await conn.execute(q)]

    async def search_notes(self, project_id: str | None, query: str, retain_hours: int, limit: int = 20) -> list[Note]:
        """The project's notes holding every word of query (in the title or the text, any
        case), the best match first. A word is taken as a phrase of its tokens ("foo-bar"
        finds "foo bar"); punctuation is never query syntax. A query without a word finds
        nothing."""
        project_id = _check_project(project_id)
        since = _window(retain_hours)
        limit = _check_page("limit", limit, 1)
        if not isinstance(query, str):
            raise StoreError(f"A note search is text, not {query!r}.")
        if "\x00" in query:
            # PostgreSQL refuses NUL in text, and an FTS5 query stops at it.
            raise StoreError("A note search cannot contain NUL characters.")
        words = _words(query)
        if not words:
            return []
        where = (_scope(memory_notes.c.project_id, project_id), memory_notes.c.updated_at >= since)
        async with self._engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                tsq: Any = func.phraseto_tsquery(_PG_SIMPLE, words[0])
                for w in words[1:]:
                    tsq = tsq.op("&&")(func.phraseto_tsquery(_PG_SIMPLE, w))
                q = (
                    select(*_NOTE_COLS)
                    .where(PG_NOTE_VECTOR.op("@@")(tsq), *where)
                    .order_by(func.ts_rank(PG_NOTE_VECTOR, tsq).desc(), memory_notes.c.updated_at.desc())
                )
            else:
                # Each word an FTS5 phrase: quoted (a quote doubled), so nothing in it is syntax.
                match = " AND ".join('"' + w.replace('"', '""') + '"' for w in words)
                q = (
                    select(*_NOTE_COLS)
                    .select_from(memory_notes.join(_fts, _fts.c.rowid == memory_notes.c.seq))
                    .where(_FTS.op("MATCH")(match), *where)
                    .order_by(func.bm25(_FTS), memory_notes.c.updated_at.desc())
                )
            return [_note(r) for r in await conn.execute(q.limit(limit))]

    async def update_note(
        self,
        project_id: str | None,
        note_id: str,
        *,
        text: str | None = None,
        title: str | None = None,
        retain_hours: int | None = None,
        quota: Quota | None = None,
    ) -> Note | None:
        """Rewrite a note's text or title (an empty title removes it); it was last written
        now. None when the project has no such note or, given retain_hours, it expired: an
        expired note is not brought back. A note grown past the quota's room is refused
        (QuotaFull) and left as it was."""
        project_id = _check_project(project_id)
        if text is None and title is None:
            raise StoreError("Give the note's new text or title (or both).")
        values: dict[str, Any] = {}
        if text is not None:
            values["text"] = _check_text(text)
        if title is not None:
            values["title"] = _check_title(title)
        where = [memory_notes.c.updated_at >= _window(retain_hours)] if retain_hours is not None else []
        if caller_id_problem("note", note_id) is not None:
            return None
        where += [memory_notes.c.id == note_id, _scope(memory_notes.c.project_id, project_id)]
        async with self._writer.begin() as conn:
            await _kept(conn, project_id)
            old = (await conn.execute(select(memory_notes.c.text, memory_notes.c.title).where(*where))).first()
            if old is None:
                return None
            grown = _utf8(values.get("text", old.text), values.get("title", old.title)) - _utf8(old.text, old.title)
            await _take(conn, project_id, 0, grown, quota)
            row = (
                await conn.execute(
                    update(memory_notes).where(*where).values(updated_at=utcnow(), **values).returning(*_NOTE_COLS)
                )
            ).first()
        return _note(row) if row else None

    async def delete_note(self, project_id: str | None, note_id: str) -> bool:
        """Forget a note now; False when the project has no such note."""
        project_id = _check_project(project_id)
        if caller_id_problem("note", note_id) is not None:
            return False
        n = memory_notes
        async with self._writer.begin() as conn:
            await _kept(conn, project_id)
            gone = list(
                await conn.execute(
                    delete(n)
                    .where(n.c.id == note_id, _scope(n.c.project_id, project_id))
                    .returning(n.c.project_id, literal_column("1"), _octets(conn, n.c.text) + _octets(conn, n.c.title))
                )
            )
            await _give_back(conn, [tuple(g) for g in gone])
        return len(gone) == 1

    # -- the sweep -----------------------------------------------------------------------

    async def sweep_agent_data(
        self, pool_threads_hours: int | None = None, pool_memory_hours: int | None = None
    ) -> Swept:
        """Remove what is past its window: threads by their last turn, response chains by
        their last response, notes by when they were last written, each by its project's
        settings (everything of a project that has it off, or is gone) and the shared pool's
        by the pool_* hours (None: the pool keeps none). One transaction per kind."""
        pool_threads_hours = _check_hours("conversations", pool_threads_hours, off_allowed=True)
        pool_memory_hours = _check_hours("notes", pool_memory_hours, off_allowed=True)
        async with self._engine.connect() as conn:
            settings = list(await conn.execute(select(project_retention)))
        keep_threads = {r.project_id: r.threads_hours for r in settings if r.threads_hours}
        keep_notes = {r.project_id: r.memory_hours for r in settings if r.memory_hours}
        now = utcnow()
        swept_threads = responses = notes = 0
        # Every counter row locked first, as a write locks its own (see _kept).
        lock_all = update(agent_storage).values(item_count=agent_storage.c.item_count)
        async with self._writer.begin() as conn:
            await conn.execute(lock_all)
            for cond in _expired(threads, threads.c.last_turn_at, keep_threads, pool_threads_hours, now):
                swept_threads += await _delete_threads(conn, cond)
        r = stored_responses
        async with self._writer.begin() as conn:
            await conn.execute(lock_all)
            for cond in _expired(r, r.c.last_turn_at, keep_threads, pool_threads_hours, now):
                gone = list(
                    await conn.execute(
                        delete(r)
                        .where(cond)
                        .returning(r.c.project_id, literal_column("1"), _octets(conn, r.c.messages))
                    )
                )
                await _give_back(conn, [tuple(g) for g in gone])
                responses += len(gone)
        async with self._writer.begin() as conn:
            await conn.execute(lock_all)
            n = memory_notes
            for cond in _expired(n, n.c.updated_at, keep_notes, pool_memory_hours, now):
                gone = list(
                    await conn.execute(
                        delete(n)
                        .where(cond)
                        .returning(
                            n.c.project_id, literal_column("1"), _octets(conn, n.c.text) + _octets(conn, n.c.title)
                        )
                    )
                )
                await _give_back(conn, [tuple(g) for g in gone])
                notes += len(gone)
        return Swept(swept_threads, responses, notes)

    async def agent_storage_used(self, project_id: str | None) -> tuple[int, int]:
        """What a project keeps now: (items, bytes), as its quota counts them."""
        project_id = _check_project(project_id)
        s = agent_storage
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(select(s.c.item_count, s.c.byte_count).where(s.c.scope == (project_id or "")))
            ).first()
        return (int(row.item_count), int(row.byte_count)) if row else (0, 0)


async def _touch_thread(
    conn: AsyncConnection, project_id: str | None, thread_id: str, now: datetime, model: str
) -> int:
    """The thread's row id, its last turn set to now; the row made when there is none."""
    ins = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(threads)
    for _ in range(2):
        got = await conn.scalar(
            update(threads)
            .where(_thread(project_id, thread_id))
            .values(last_turn_at=now, model=model)
            .returning(threads.c.id)
        )
        if got is not None:
            return int(got)
        # Two first turns at once (PostgreSQL): the second waits for the first, does nothing,
        # and the update above then finds the row.
        got = await conn.scalar(
            ins.values(project_id=project_id, thread_id=thread_id, created_at=now, last_turn_at=now, model=model)
            .on_conflict_do_nothing()
            .returning(threads.c.id)
        )
        if got is not None:
            return int(got)
    raise StoreError(f"The thread {thread_id} could not be written; try the turn again.")  # pragma: no cover
