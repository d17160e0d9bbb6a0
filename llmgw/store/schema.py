"""Table definitions used by queries (Core). Migrations define their own copies: a
revision must keep describing the schema as it was, whatever this file becomes."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (BigInteger, Boolean, Column, DateTime, Float, Index, Integer,
                        MetaData, String, Table, Text)
from sqlalchemy.types import TypeDecorator

KEYS_GENERATION = "keys_generation"


class UTCDateTime(TypeDecorator):
    """Aware UTC datetimes on both backends. SQLite keeps DateTime as naive text, so
    values go in as UTC (tz stripped) and come back with UTC attached; the fixed text
    format keeps comparisons in SQL correct."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("store timestamps must be timezone-aware")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


metadata = MetaData()

api_keys = Table(
    "api_keys", metadata,
    Column("id", String(32), primary_key=True),
    Column("name", Text, nullable=False),
    Column("prefix", String(32), nullable=False, index=True),
    Column("hash", String(64), nullable=False, unique=True),
    Column("project", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime, nullable=True),
    Column("last_used_at", UTCDateTime, nullable=True),
    Column("expires_at", UTCDateTime, nullable=True),
)

usage = Table(
    "usage", metadata,
    # BIGINT is not SQLite's rowid alias, so it would not autoincrement there.
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True,
           autoincrement=True),
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
    # Per-key usage pages read a key's newest rows.
    Index("ix_usage_key_id_at", "key_id", "at"),
)

store_state = Table(
    "store_state", metadata,
    Column("name", String(64), primary_key=True),
    Column("value", BigInteger, nullable=False),
)

# Models added at run time (`ctl model add`); the spec is the model's validated JSON,
# re-validated on every load so a newer llmgw applies its own rules to it.
catalog_models = Table(
    "catalog_models", metadata,
    Column("name", String(200), primary_key=True),
    Column("spec", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)

# Nodes an operator cordoned or is draining: "cordoned" or "draining".
node_marks = Table(
    "node_marks", metadata,
    Column("node_id", String(200), primary_key=True),
    Column("mark", String(20), nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)
