"""Admin tokens (the admin API's credential) and a unique id per usage row.

The id makes writing a row idempotent: rows replayed from the usage journal
after a crash are inserted once even if an earlier replay already wrote them.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "admin_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("prefix", sa.String(32), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
    )
    # Nullable: rows written before this revision have none; SQLite adds it in place.
    op.add_column("usage", sa.Column("request_id", sa.String(32), nullable=True))
    op.create_index("ux_usage_request_id", "usage", ["request_id"], unique=True)


def downgrade() -> None:
    op.drop_index("ux_usage_request_id", table_name="usage")
    with op.batch_alter_table("usage") as b:
        b.drop_column("request_id")
    op.drop_table("admin_tokens")
