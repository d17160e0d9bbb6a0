"""Table definitions used by queries (Core). Migrations define their own copies: a
revision must keep describing the schema as it was, whatever this file becomes."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
    update,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

KEYS_GENERATION = "keys_generation"


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on both backends. SQLite keeps DateTime as naive text, so
    values go in as UTC (tz stripped) and come back with UTC attached; the fixed text
    format keeps comparisons in SQL correct."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("store timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


metadata = MetaData()

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", Text, nullable=False),
    Column("prefix", String(32), nullable=False, index=True),
    Column("hash", String(64), nullable=False, unique=True),
    Column("project", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime, nullable=True),
    Column("last_used_at", UTCDateTime, nullable=True),
    Column("expires_at", UTCDateTime, nullable=True),
    Column("project_id", String(32), nullable=True, index=True),  # null: a personal key
    Column("user_id", String(32), nullable=True, index=True),  # the owner, if a person
    Column("band", String(16), nullable=True),  # null: inherits
)

usage = Table(
    "usage",
    metadata,
    # BIGINT is not SQLite's rowid alias, so it would not autoincrement there.
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True),
    Column("at", UTCDateTime, nullable=False, index=True),
    Column("key_id", String(32), nullable=True),
    Column("project", Text, nullable=True),
    Column("model", Text, nullable=False),
    Column("served_model", Text, nullable=True),
    Column("endpoint", Text, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("latency_ms", Float, nullable=False),
    Column("ttft_ms", Float, nullable=True),
    Column("status", Integer, nullable=False),
    Column("stream", Boolean, nullable=False),
    Column("user_id", String(32), nullable=True),
    Column("project_id", String(32), nullable=True),
    Column("team_id", String(32), nullable=True),
    Column("org_id", String(32), nullable=True),
    Column("cost_micros", BigInteger, nullable=False, server_default="0"),
    # Unique per request (0005): a row replayed from the usage journal is written once.
    Column("request_id", String(32), nullable=True),
    Index("ux_usage_request_id", "request_id", unique=True),
    # Per-key usage pages read a key's newest rows.
    Index("ix_usage_key_id_at", "key_id", "at"),
)

store_state = Table(
    "store_state",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", BigInteger, nullable=False),
)

# Models added at run time (`ctl model add`); the spec is the model's validated JSON,
# re-validated on every load so a newer llmgw applies its own rules to it.
catalog_models = Table(
    "catalog_models",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("spec", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)

# Nodes an operator cordoned or is draining: "cordoned" or "draining".
node_marks = Table(
    "node_marks",
    metadata,
    Column("node_id", String(200), primary_key=True),
    Column("mark", String(20), nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)

# -- tenancy (0004) -----------------------------------------------------------------

organizations = Table(
    "organizations",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    UniqueConstraint("name", name="uq_organizations_name"),
)

teams = Table(
    "teams",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("org_id", String(32), ForeignKey("organizations.id"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    UniqueConstraint("org_id", "name", name="uq_teams_org_id_name"),
)

projects = Table(
    "projects",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("team_id", String(32), ForeignKey("teams.id"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    UniqueConstraint("team_id", "name", name="uq_projects_team_id_name"),
)

users = Table(
    "users",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("email", String(320), nullable=False, unique=True),
    Column("name", Text, nullable=True),
    Column("password_hash", Text, nullable=True),  # argon2id
    Column("state", String(16), nullable=False),  # active | suspended | pending (a sign-up)
    Column("admin", Boolean, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

memberships = Table(
    "memberships",
    metadata,
    Column("user_id", String(32), ForeignKey("users.id"), primary_key=True),
    Column("scope", String(16), primary_key=True),  # org | team | project
    Column("scope_id", String(32), primary_key=True),
    Column("role", String(16), nullable=False),  # member | manager (organizations only)
    Column("created_at", UTCDateTime, nullable=False),
)

# One row per level that sets anything; clearing a level deletes its row.
limits = Table(
    "limits",
    metadata,
    Column("scope", String(20), primary_key=True),  # org | team | project | user | key | *-member
    Column("scope_id", String(32), primary_key=True),
    Column("rpm", Integer, nullable=True),
    Column("tpm", Integer, nullable=True),
    Column("budget_micros", BigInteger, nullable=True),
    Column("period", String(8), nullable=False),  # day | month
    Column("models", Text, nullable=True),  # JSON list of names; null: no restriction
    Column("band", String(16), nullable=True),  # org, team and project levels
    Column("updated_at", UTCDateTime, nullable=False),
)

key_claims = Table(
    "key_claims",
    metadata,
    Column("token_hash", String(64), primary_key=True),
    Column("key_id", String(32), ForeignKey("api_keys.id"), nullable=False),
    Column("sealed", Text, nullable=False),  # the secret sealed with the token; "" once used
    Column("created_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False),
    Column("used_at", UTCDateTime, nullable=True),
)

# Credentials of the admin API (0005): random tokens, kept as sha256 with a visible prefix.
admin_tokens = Table(
    "admin_tokens",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", Text, nullable=False),
    Column("prefix", String(32), nullable=False),
    Column("hash", String(64), nullable=False, unique=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime, nullable=True),
    Column("last_used_at", UTCDateTime, nullable=True),
)

# Signed-in browsers (0006): the token lives in a cookie, only its sha256 here; the CSRF
# token is kept as is (it proves a form came from our page, and opens nothing alone).
browser_sessions = Table(
    "browser_sessions",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("user_id", String(32), ForeignKey("users.id"), nullable=False, index=True),
    Column("csrf", String(64), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("last_seen_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False, index=True),
)

# Every change to limits (0007): who made it (an administrator's email from the pages; null
# from the CLI) and the level's row before and after, as JSON (null: no row).
limit_changes = Table(
    "limit_changes",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True),
    Column("at", UTCDateTime, nullable=False, index=True),
    Column("changed_by", Text, nullable=True),
    Column("scope", String(20), nullable=False),
    Column("scope_id", String(32), nullable=False),
    Column("old", Text, nullable=True),
    Column("new", Text, nullable=True),
)

# Every change to keys, the tree, people, memberships or limits runs this in its
# transaction; a server polls the counter and reloads its keys when it moves.
BUMP_GENERATION = update(store_state).where(store_state.c.name == KEYS_GENERATION).values(value=store_state.c.value + 1)

# A named claim with an expiry (0008): control-plane leadership. Times are seconds since the
# epoch by the database's clock (see leases.py).
leases = Table(
    "leases",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("owner", String(64), nullable=False),
    Column("holder", Text, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("renewed_at", Float, nullable=False),
)

# The ready replicas' endpoints as the leading control plane last published them (0008): a
# standby's gateway serves them while it does not lead.
replica_endpoints = Table(
    "replica_endpoints",
    metadata,
    Column("replica_id", String(64), primary_key=True),
    Column("model", String(200), nullable=False),
    Column("url", Text, nullable=False),
    Column("engine", String(32), nullable=False),
    Column("api_key", Text, nullable=True),
    Column("published_at", UTCDateTime, nullable=False),
)

# -- shared limits (0009) -----------------------------------------------------------
# Gateways on one store enforce rate limits together (allowance.py): each holds a share of a
# pool's per-minute allowance, leased from here; a pool's row is the lock its claims take.
# Times are seconds since the epoch by the database's clock.
rate_pools = Table(
    "rate_pools",
    metadata,
    Column("pool_key", String(200), primary_key=True),
    Column("kind", String(8), primary_key=True),  # rpm | tpm
)

rate_shares = Table(
    "rate_shares",
    metadata,
    Column("pool_key", String(200), primary_key=True),
    Column("kind", String(8), primary_key=True),
    Column("gateway", String(64), primary_key=True),  # random per gateway process
    Column("share", BigInteger, nullable=False),
    # Renewed by its gateway; counted until TAIL_S after it (what was admitted under it ages out).
    Column("expires_at", Float, nullable=False),
    Index("ix_rate_shares_gateway", "gateway"),
)

# What each gateway process spent, per pool, in the UTC day and month named by its keys
# (absolute totals since that process started); the others read it to keep budgets together.
gateway_spend = Table(
    "gateway_spend",
    metadata,
    Column("gateway", String(64), primary_key=True),
    Column("pool_key", String(200), primary_key=True),
    Column("day_key", Integer, nullable=False),
    Column("day_micros", BigInteger, nullable=False),
    Column("month_key", Integer, nullable=False),
    Column("month_micros", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
    Index("ix_gateway_spend_updated_at", "updated_at"),
)

# -- conversations, stored responses and notes for agents (0010, agents.py) ----------
# Kept only for projects that turned them on (project_retention), or in the shared pool
# (project_id null) a gateway without authentication uses. Big integer keys are SQLite's
# rowid there, so they autoincrement.
_ROWID = BigInteger().with_variant(Integer(), "sqlite")

# One row per project with either setting on; hours null: off.
project_retention = Table(
    "project_retention",
    metadata,
    Column("project_id", String(32), ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True),
    Column("threads_hours", Integer, nullable=True),
    Column("memory_hours", Integer, nullable=True),
    Column("updated_at", UTCDateTime, nullable=False),
)

threads = Table(
    "threads",
    metadata,
    Column("id", _ROWID, primary_key=True, autoincrement=True),
    Column("project_id", String(32), ForeignKey("projects.id", ondelete="CASCADE"), nullable=True),
    Column("thread_id", String(64), nullable=False),  # the client's; unique within its project
    Column("created_at", UTCDateTime, nullable=False),
    Column("last_turn_at", UTCDateTime, nullable=False),
    Column("model", Text, nullable=True),  # the last turn's
    Index("ux_threads_project_thread", "project_id", "thread_id", unique=True),
    # NULLs are distinct in a unique index: the pool's ids need one of their own.
    Index(
        "ux_threads_pool_thread",
        "thread_id",
        unique=True,
        sqlite_where=text("project_id IS NULL"),
        postgresql_where=text("project_id IS NULL"),
    ),
    Index("ix_threads_project_last_turn", "project_id", "last_turn_at"),
)

thread_messages = Table(
    "thread_messages",
    metadata,
    Column("thread", _ROWID, ForeignKey("threads.id", ondelete="CASCADE"), primary_key=True),  # threads.id
    Column("seq", Integer, primary_key=True),
    Column("message", Text, nullable=False),  # one chat-format message, as JSON
)

# One Responses-API response: its turn's chat-format messages (a JSON list). last_turn_at
# moves with every response that continues the chain, so a chain in use is kept whole.
stored_responses = Table(
    "stored_responses",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("project_id", String(32), ForeignKey("projects.id", ondelete="CASCADE"), nullable=True),
    Column("previous_id", String(64), nullable=True),  # no foreign key: the sweep cuts chains
    Column("messages", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("last_turn_at", UTCDateTime, nullable=False),
    Index("ix_stored_responses_project_last_turn", "project_id", "last_turn_at"),
)

# seq is the rowid SQLite's search index (NOTES_SEARCH, below) refers to: an explicit
# integer key, which VACUUM keeps (it may renumber an implicit rowid).
memory_notes = Table(
    "memory_notes",
    metadata,
    Column("seq", _ROWID, primary_key=True, autoincrement=True),
    Column("id", String(32), nullable=False, unique=True),  # note_ + 24 hex
    Column("project_id", String(32), ForeignKey("projects.id", ondelete="CASCADE"), nullable=True),
    Column("title", String(200), nullable=True),
    Column("text", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Index("ix_memory_notes_project_updated", "project_id", "updated_at"),
)

# What each project keeps (0013): items (threads, stored responses, notes) and bytes (messages
# as JSON, notes' text and title, UTF-8); scope is the project's id, '' for the shared pool. No
# foreign key, so the pool has a row too; a removed project's row counts nothing anyone reads.
agent_storage = Table(
    "agent_storage",
    metadata,
    Column("scope", String(32), primary_key=True),
    Column("item_count", BigInteger, nullable=False),
    Column("byte_count", BigInteger, nullable=False),
)

# SQLite's note search: an FTS5 table over memory_notes (external content) and the
# tables FTS5 makes for it, kept in step by triggers. Derived from memory_notes, so not
# part of the schema above: a copy of the store rebuilds it as the notes go in.
NOTES_SEARCH = "memory_notes_fts"


def is_derived_table(name: str) -> bool:
    """Whether a table the migrations made is derived data (the note search), not rows to copy."""
    return name == NOTES_SEARCH or name.startswith(NOTES_SEARCH + "_")


# -- measured capacity (0011, capacity.py) --------------------------------------------
# What one replica of a model on one profile served at an SLO (`llmgw ctl bench --save`);
# re-measuring replaces the row. Times in seconds.
model_capacity = Table(
    "model_capacity",
    metadata,
    Column("model", String(200), primary_key=True),
    Column("profile", String(200), primary_key=True),
    Column("concurrent", Integer, nullable=False),  # 0: not even one request at a time met the SLO
    Column("tokens_per_s", Float, nullable=False),
    Column("ttft_p99", Float, nullable=True),  # at the level that held; null when none did
    Column("tpot_p99", Float, nullable=True),
    Column("wait", Integer, nullable=True),  # the engine's own queue seen there; null: not published
    Column("kv", Float, nullable=True),  # its KV-cache use seen there, 0 to 1
    Column("slo_ttft_p99", Float, nullable=False),
    Column("slo_tpot_p99", Float, nullable=False),
    Column("target", Text, nullable=False),
    Column("measured_at", UTCDateTime, nullable=False),
    Column("measured_by", Text, nullable=True),
)

# -- sign-in attempts (0012, signin.py) ------------------------------------------------
# Counted before a password is checked; times are seconds since the epoch by the database's
# clock, so every gateway judges one window alike.
signin_keys = Table(
    "signin_keys",
    metadata,
    Column("key", String(400), primary_key=True),  # "account:EMAIL" or "address:ADDRESS"; the lock row
    Column("seen_at", Float, nullable=False),
    Index("ix_signin_keys_seen_at", "seen_at"),
)

signin_attempts = Table(
    "signin_attempts",
    metadata,
    Column("attempt", String(32), primary_key=True),
    Column("key", String(400), primary_key=True),
    Column("at", Float, nullable=False),
    Index("ix_signin_attempts_key_at", "key", "at"),
    Index("ix_signin_attempts_at", "at"),
)
