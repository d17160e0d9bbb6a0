"""Browser sessions for the web pages; people gain the `pending` state (a sign-up
waiting for approval), which needs no schema change: state is free text.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_ID = 32


def upgrade() -> None:
    op.create_table(
        "browser_sessions",
        sa.Column("id", sa.String(_ID), primary_key=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),  # sha256 of the cookie's token
        sa.Column("user_id", sa.String(_ID), sa.ForeignKey("users.id"), nullable=False),
        sa.Column("csrf", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_browser_sessions_user_id", "browser_sessions", ["user_id"])
    # Expired sessions are swept by expiry.
    op.create_index("ix_browser_sessions_expires_at", "browser_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_browser_sessions_expires_at", table_name="browser_sessions")
    op.drop_index("ix_browser_sessions_user_id", table_name="browser_sessions")
    op.drop_table("browser_sessions")
