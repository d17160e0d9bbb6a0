"""Plain values the store hands out and takes in."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    name: str
    prefix: str
    # Only active_keys() loads the hash (authentication needs it; listings do not).
    hash: str | None
    project: str | None
    created_at: datetime
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None
    expires_at: datetime | None = None

    def is_active(self, now: datetime | None = None) -> bool:
        """Not revoked and not expired at `now`; expiry does not bump keys_generation,
        so a server holding keys in memory must check it per request."""
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > (now or utcnow())


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageRow:
    model: str
    endpoint: str
    status: int
    latency_ms: float
    key_id: str | None = None
    project: str | None = None
    served_model: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    stream: bool = False
    at: datetime = field(default_factory=utcnow)
    id: int | None = None  # set by the database; ignored on insert
