"""Conversations (threads and their messages), stored Responses-API responses and memory
notes for agents, kept per project for as long as its retention settings say, and the note
search: an FTS5 table kept in step by three triggers on SQLite, a GIN index over the
notes' tsvector on PostgreSQL.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_ID = 32
_CALLER_ID = 64  # thread and response ids, chosen by the gateway or its client
_ROWID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite's rowid: autoincrements

# External content: the FTS table keeps only the index, reading text from memory_notes by
# its integer key seq. The 'delete' rows must repeat the values indexed, hence old.*.
# remove_diacritics 0: PostgreSQL's 'simple' configuration keeps accents too, so "cafe" finds
# "café" on neither.
_SQLITE_SEARCH = [
    "CREATE VIRTUAL TABLE memory_notes_fts USING fts5(title, text, content='memory_notes', "
    "content_rowid='seq', tokenize='unicode61 remove_diacritics 0')",
    "CREATE TRIGGER memory_notes_fts_ai AFTER INSERT ON memory_notes BEGIN "
    "INSERT INTO memory_notes_fts(rowid, title, text) VALUES (new.seq, new.title, new.text); END",
    "CREATE TRIGGER memory_notes_fts_ad AFTER DELETE ON memory_notes BEGIN "
    "INSERT INTO memory_notes_fts(memory_notes_fts, rowid, title, text) "
    "VALUES ('delete', old.seq, old.title, old.text); END",
    "CREATE TRIGGER memory_notes_fts_au AFTER UPDATE ON memory_notes BEGIN "
    "INSERT INTO memory_notes_fts(memory_notes_fts, rowid, title, text) "
    "VALUES ('delete', old.seq, old.title, old.text); "
    "INSERT INTO memory_notes_fts(rowid, title, text) VALUES (new.seq, new.title, new.text); END",
]
# An index on the expression, not a generated column: a column PostgreSQL alone has would be
# one the schema (and so move-store's copy) cannot carry on both. Queries repeat the
# expression exactly (agents.py, PG_NOTE_VECTOR), which is what lets them use the index.
_PG_SEARCH = [
    "CREATE INDEX ix_memory_notes_search ON memory_notes "
    "USING GIN (to_tsvector('simple', coalesce(title, '') || ' ' || text))",
]


def upgrade() -> None:
    op.create_table(
        "project_retention",
        sa.Column("project_id", sa.String(_ID), sa.ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("threads_hours", sa.Integer, nullable=True),  # null: conversations off
        sa.Column("memory_hours", sa.Integer, nullable=True),  # null: notes off
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "threads",
        sa.Column("id", _ROWID, primary_key=True, autoincrement=True),
        # null: the shared pool of a gateway without authentication
        sa.Column("project_id", sa.String(_ID), sa.ForeignKey("projects.id", ondelete="CASCADE"), nullable=True),
        sa.Column("thread_id", sa.String(_CALLER_ID), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_turn_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.Text, nullable=True),
    )
    op.create_index("ux_threads_project_thread", "threads", ["project_id", "thread_id"], unique=True)
    # NULLs are distinct in a unique index, so the pool's ids are unique by an index of their own.
    op.create_index(
        "ux_threads_pool_thread",
        "threads",
        ["thread_id"],
        unique=True,
        sqlite_where=sa.text("project_id IS NULL"),
        postgresql_where=sa.text("project_id IS NULL"),
    )
    op.create_index("ix_threads_project_last_turn", "threads", ["project_id", "last_turn_at"])
    op.create_table(
        "thread_messages",
        sa.Column("thread", _ROWID, sa.ForeignKey("threads.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("message", sa.Text, nullable=False),  # JSON
    )
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(_CALLER_ID), primary_key=True),
        sa.Column("project_id", sa.String(_ID), sa.ForeignKey("projects.id", ondelete="CASCADE"), nullable=True),
        sa.Column("previous_id", sa.String(_CALLER_ID), nullable=True),
        sa.Column("messages", sa.Text, nullable=False),  # JSON list
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_turn_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_stored_responses_project_last_turn", "stored_responses", ["project_id", "last_turn_at"])
    op.create_table(
        "memory_notes",
        sa.Column("seq", _ROWID, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(_ID), nullable=False, unique=True),
        sa.Column("project_id", sa.String(_ID), sa.ForeignKey("projects.id", ondelete="CASCADE"), nullable=True),
        sa.Column("title", sa.String(200), nullable=True),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_memory_notes_project_updated", "memory_notes", ["project_id", "updated_at"])
    for statement in _SQLITE_SEARCH if op.get_bind().dialect.name == "sqlite" else _PG_SEARCH:
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for trigger in ("memory_notes_fts_au", "memory_notes_fts_ad", "memory_notes_fts_ai"):
            op.execute(f"DROP TRIGGER {trigger}")
        op.execute("DROP TABLE memory_notes_fts")
    else:
        op.drop_index("ix_memory_notes_search", table_name="memory_notes")
    op.drop_index("ix_memory_notes_project_updated", table_name="memory_notes")
    op.drop_table("memory_notes")
    op.drop_index("ix_stored_responses_project_last_turn", table_name="stored_responses")
    op.drop_table("stored_responses")
    op.drop_table("thread_messages")
    op.drop_index("ix_threads_project_last_turn", table_name="threads")
    op.drop_index("ux_threads_pool_thread", table_name="threads")
    op.drop_index("ux_threads_project_thread", table_name="threads")
    op.drop_table("threads")
    op.drop_table("project_retention")
