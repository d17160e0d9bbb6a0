"""API keys, usage and the keys generation counter.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("prefix", sa.String(32), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("project", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("hash", name="uq_api_keys_hash"),
    )
    op.create_index("ix_api_keys_prefix", "api_keys", ["prefix"])

    op.create_table(
        "usage",
        # BIGINT is not SQLite's rowid alias, so it would not autoincrement there.
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("project", sa.Text, nullable=True),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("served_model", sa.Text, nullable=True),
        sa.Column("endpoint", sa.Text, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("latency_ms", sa.Float, nullable=False),
        sa.Column("ttft_ms", sa.Float, nullable=True),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("stream", sa.Boolean, nullable=False),
    )
    op.create_index("ix_usage_at", "usage", ["at"])
    op.create_index("ix_usage_key_id_at", "usage", ["key_id", "at"])

    state = op.create_table(
        "store_state",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(state, [{"name": "keys_generation", "value": 0}])


def downgrade() -> None:
    op.drop_table("store_state")
    op.drop_index("ix_usage_key_id_at", table_name="usage")
    op.drop_index("ix_usage_at", table_name="usage")
    op.drop_table("usage")
    op.drop_index("ix_api_keys_prefix", table_name="api_keys")
    op.drop_table("api_keys")
