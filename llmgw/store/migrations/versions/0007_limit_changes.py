"""A log of every change to limits: when, who made it, the level, and its row before and after.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "limit_changes",
        # BIGINT is not SQLite's rowid alias, so it would not autoincrement there.
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        # An administrator's email (the pages); null where the change came from elsewhere (the CLI).
        sa.Column("changed_by", sa.Text, nullable=True),
        sa.Column("scope", sa.String(20), nullable=False),  # org | team | project | user | key | *-member
        sa.Column("scope_id", sa.String(32), nullable=False),
        sa.Column("old", sa.Text, nullable=True),  # the level's limits as JSON; null: it had no row
        sa.Column("new", sa.Text, nullable=True),  # null: the row was removed
    )
    op.create_index("ix_limit_changes_at", "limit_changes", ["at"])


def downgrade() -> None:
    op.drop_index("ix_limit_changes_at", table_name="limit_changes")
    op.drop_table("limit_changes")
