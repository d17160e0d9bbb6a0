"""What each project keeps for its agents, counted: items (conversations, stored responses,
notes) and bytes (their messages as JSON, the notes' text and title, as UTF-8), one row per
project ('' for the shared pool of a gateway without authentication). Its row is locked by
every write that adds to it, which is what makes the quota exact across processes and
gateways (agents.py). Filled from what is kept already.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "agent_storage",
        sa.Column("scope", sa.String(32), primary_key=True),
        sa.Column("item_count", sa.BigInteger, nullable=False),
        sa.Column("byte_count", sa.BigInteger, nullable=False),
    )
    pg = op.get_bind().dialect.name == "postgresql"

    def octets(col: str) -> str:
        return f"coalesce(octet_length({col}), 0)" if pg else f"coalesce(length(CAST({col} AS BLOB)), 0)"

    parts = (
        f"SELECT coalesce(project_id, '') AS scope, count(*) AS items, "
        f"sum({octets('text')} + {octets('title')}) AS bytes FROM memory_notes GROUP BY project_id",
        f"SELECT coalesce(project_id, '') AS scope, count(*) AS items, sum({octets('messages')}) AS bytes "
        "FROM stored_responses GROUP BY project_id",
        "SELECT coalesce(project_id, '') AS scope, count(*) AS items, 0 AS bytes FROM threads GROUP BY project_id",
        f"SELECT coalesce(t.project_id, '') AS scope, 0 AS items, sum({octets('m.message')}) AS bytes "
        "FROM thread_messages m JOIN threads t ON t.id = m.thread GROUP BY t.project_id",
    )
    op.execute(
        "INSERT INTO agent_storage (scope, item_count, byte_count) SELECT scope, sum(items), sum(bytes) FROM ("
        + " UNION ALL ".join(parts)
        + ") AS kept GROUP BY scope"
    )


def downgrade() -> None:
    op.drop_table("agent_storage")
