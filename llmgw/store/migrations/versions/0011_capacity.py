"""Measured capacity (`llmgw ctl bench --save`): what one replica of a model on one profile
served while it still met a latency target, kept per model and profile. Re-measuring
replaces the row.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_capacity",
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("profile", sa.String(200), primary_key=True),
        # The most requests in flight at once that still met the SLO; 0: not even one did.
        sa.Column("concurrent", sa.Integer, nullable=False),
        sa.Column("tokens_per_s", sa.Float, nullable=False),  # output tokens per second at that level
        sa.Column("ttft_p99", sa.Float, nullable=True),  # seconds, at that level; null when none held
        sa.Column("tpot_p99", sa.Float, nullable=True),
        sa.Column("wait", sa.Integer, nullable=True),  # the engine's own queue seen at that level
        sa.Column("kv", sa.Float, nullable=True),  # the KV-cache use seen at that level, 0 to 1
        sa.Column("slo_ttft_p99", sa.Float, nullable=False),  # the targets it was measured against
        sa.Column("slo_tpot_p99", sa.Float, nullable=False),
        sa.Column("target", sa.Text, nullable=False),  # the endpoint the load went to
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("measured_by", sa.Text, nullable=True),  # the admin credential that saved it
    )


def downgrade() -> None:
    op.drop_table("model_capacity")
