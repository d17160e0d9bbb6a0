"""Shared limits: the shares of rate pools gateways lease from the store, the pools' lock
rows, and what each gateway spent, so limits hold across gateways on one store.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_POOL = 200  # a pool key: "project-member:ID:USER" and the like
_GATEWAY = 64


def upgrade() -> None:
    # One row per (pool, kind) ever claimed: the row a claim locks, so two gateways'
    # claims on one pool take turns.
    op.create_table(
        "rate_pools",
        sa.Column("pool_key", sa.String(_POOL), primary_key=True),
        sa.Column("kind", sa.String(8), primary_key=True),  # rpm | tpm
    )
    op.create_table(
        "rate_shares",
        sa.Column("pool_key", sa.String(_POOL), primary_key=True),
        sa.Column("kind", sa.String(8), primary_key=True),
        sa.Column("gateway", sa.String(_GATEWAY), primary_key=True),  # random per gateway process
        sa.Column("share", sa.BigInteger, nullable=False),
        # Seconds since the epoch by the database's clock; the gateway renews it.
        sa.Column("expires_at", sa.Float, nullable=False),
    )
    op.create_index("ix_rate_shares_gateway", "rate_shares", ["gateway"])
    op.create_table(
        "gateway_spend",
        sa.Column("gateway", sa.String(_GATEWAY), primary_key=True),
        sa.Column("pool_key", sa.String(_POOL), primary_key=True),
        sa.Column("day_key", sa.Integer, nullable=False),  # the UTC day's ordinal
        sa.Column("day_micros", sa.BigInteger, nullable=False),
        sa.Column("month_key", sa.Integer, nullable=False),  # year * 12 + month - 1
        sa.Column("month_micros", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),  # by the database's clock
    )
    op.create_index("ix_gateway_spend_updated_at", "gateway_spend", ["updated_at"])


def downgrade() -> None:
    op.drop_index("ix_gateway_spend_updated_at", table_name="gateway_spend")
    op.drop_table("gateway_spend")
    op.drop_index("ix_rate_shares_gateway", table_name="rate_shares")
    op.drop_table("rate_shares")
    op.drop_table("rate_pools")
