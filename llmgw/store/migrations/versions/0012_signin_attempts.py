"""Sign-in attempts, counted in the store before a password is checked, so every worker and
every gateway on one store shares one count per account and per address.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_KEY = 400  # "account:" + an email (320) or "address:" + an address or an IPv6 /64


def upgrade() -> None:
    # One row per counted thing ever attempted recently: the row an attempt locks, so two
    # attempts on one account (or address) are counted one after the other.
    op.create_table(
        "signin_keys",
        sa.Column("key", sa.String(_KEY), primary_key=True),
        sa.Column("seen_at", sa.Float, nullable=False),  # by the database's clock; swept a window later
    )
    op.create_index("ix_signin_keys_seen_at", "signin_keys", ["seen_at"])
    # One row per attempt and thing it counts against (its account, its address).
    op.create_table(
        "signin_attempts",
        sa.Column("attempt", sa.String(32), primary_key=True),  # random; a right password withdraws it
        sa.Column("key", sa.String(_KEY), primary_key=True),
        sa.Column("at", sa.Float, nullable=False),  # seconds since the epoch, by the database's clock
    )
    op.create_index("ix_signin_attempts_key_at", "signin_attempts", ["key", "at"])
    op.create_index("ix_signin_attempts_at", "signin_attempts", ["at"])


def downgrade() -> None:
    op.drop_index("ix_signin_attempts_at", table_name="signin_attempts")
    op.drop_index("ix_signin_attempts_key_at", table_name="signin_attempts")
    op.drop_table("signin_attempts")
    op.drop_index("ix_signin_keys_seen_at", table_name="signin_keys")
    op.drop_table("signin_keys")
