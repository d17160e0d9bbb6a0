"""Cordoned and draining nodes, so an operator's cordon survives a control-plane restart.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_marks",
        sa.Column("node_id", sa.String(200), primary_key=True),
        sa.Column("mark", sa.String(20), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_marks")
