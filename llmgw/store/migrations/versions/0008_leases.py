"""Leases: a named claim with an owner and an expiry, for leadership between control planes;
and the ready replicas' endpoints the leader publishes, so a standby's gateway can serve them.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False),  # random per process
        sa.Column("holder", sa.Text, nullable=False),  # who holds it, in words (host, admin address)
        # Seconds since the epoch by the database's own clock, so that every process judges
        # expiry by one clock whatever its own says.
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("renewed_at", sa.Float, nullable=False),
    )
    op.create_table(
        "replica_endpoints",
        sa.Column("replica_id", sa.String(64), primary_key=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("engine", sa.String(32), nullable=False),
        # The engine's own key (made per replica by the control plane); the store already holds
        # what opens every door (admin token hashes that can be replaced, the tenancy), so this
        # adds no new way in for someone who can read it.
        sa.Column("api_key", sa.Text, nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("replica_endpoints")
    op.drop_table("leases")
