"""The tenancy tree (organizations, teams, projects), people, memberships, limits,
claim links; keys gain a project, an owner and a band; usage gains the tree and a cost.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_ID = 32


def upgrade() -> None:
    op.create_table(
        "organizations",
        sa.Column("id", sa.String(_ID), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("name", name="uq_organizations_name"),
    )
    op.create_table(
        "teams",
        sa.Column("id", sa.String(_ID), primary_key=True),
        sa.Column("org_id", sa.String(_ID), sa.ForeignKey("organizations.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("org_id", "name", name="uq_teams_org_id_name"),
    )
    op.create_table(
        "projects",
        sa.Column("id", sa.String(_ID), primary_key=True),
        sa.Column("team_id", sa.String(_ID), sa.ForeignKey("teams.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("team_id", "name", name="uq_projects_team_id_name"),
    )
    op.create_table(
        "users",
        sa.Column("id", sa.String(_ID), primary_key=True),
        sa.Column("email", sa.String(320), nullable=False),
        sa.Column("name", sa.Text, nullable=True),
        sa.Column("password_hash", sa.Text, nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("admin", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("email", name="uq_users_email"),
    )
    op.create_table(
        "memberships",
        sa.Column("user_id", sa.String(_ID), sa.ForeignKey("users.id"), primary_key=True),
        sa.Column("scope", sa.String(16), primary_key=True),  # org | team | project
        sa.Column("scope_id", sa.String(_ID), primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),  # member | manager
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_memberships_scope", "memberships", ["scope", "scope_id"])
    op.create_table(
        "limits",
        sa.Column("scope", sa.String(20), primary_key=True),
        sa.Column("scope_id", sa.String(_ID), primary_key=True),
        sa.Column("rpm", sa.Integer, nullable=True),
        sa.Column("tpm", sa.Integer, nullable=True),
        sa.Column("budget_micros", sa.BigInteger, nullable=True),
        sa.Column("period", sa.String(8), nullable=False, server_default="month"),
        sa.Column("models", sa.Text, nullable=True),  # JSON list; null: no restriction
        sa.Column("band", sa.String(16), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "key_claims",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(_ID), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("sealed", sa.Text, nullable=False),  # emptied when the claim is used
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
    )
    # Nullable columns: SQLite adds them in place, no table rebuild.
    op.add_column("api_keys", sa.Column("project_id", sa.String(_ID), nullable=True))
    op.add_column("api_keys", sa.Column("user_id", sa.String(_ID), nullable=True))
    op.add_column("api_keys", sa.Column("band", sa.String(16), nullable=True))
    op.create_index("ix_api_keys_project_id", "api_keys", ["project_id"])
    op.create_index("ix_api_keys_user_id", "api_keys", ["user_id"])
    for col in ("user_id", "project_id", "team_id", "org_id"):
        op.add_column("usage", sa.Column(col, sa.String(_ID), nullable=True))
    op.add_column("usage", sa.Column("cost_micros", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("usage") as b:
        for col in ("cost_micros", "org_id", "team_id", "project_id", "user_id"):
            b.drop_column(col)
    op.drop_index("ix_api_keys_user_id", table_name="api_keys")
    op.drop_index("ix_api_keys_project_id", table_name="api_keys")
    with op.batch_alter_table("api_keys") as b:
        for col in ("band", "user_id", "project_id"):
            b.drop_column(col)
    op.drop_table("key_claims")
    op.drop_table("limits")
    op.drop_index("ix_memberships_scope", table_name="memberships")
    op.drop_table("memberships")
    op.drop_table("users")
    op.drop_table("projects")
    op.drop_table("teams")
    op.drop_table("organizations")
