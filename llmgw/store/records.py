"""Plain values the store hands out and takes in."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal


def utcnow() -> datetime:
    return datetime.now(UTC)


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
    project_id: str | None = None  # the project in the tree; None with user_id: a personal key
    user_id: str | None = None  # the owner, if a person
    band: str | None = None  # None: inherits from the project, team, organization

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
    user_id: str | None = None
    project_id: str | None = None
    team_id: str | None = None
    org_id: str | None = None
    cost_micros: int = 0
    # Random per request, unique in the store: writing a row twice (a retried batch, a
    # journal replayed again after a crash) stores it once. None only on rows older than 0005.
    request_id: str | None = field(default_factory=lambda: secrets.token_hex(16))
    id: int | None = None  # set by the database; ignored on insert


# -- tenancy ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Org:
    id: str
    name: str

    @property
    def path(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class Team:
    id: str
    name: str
    org_id: str
    path: str  # Acme/platform


@dataclass(frozen=True, slots=True)
class Project:
    id: str
    name: str
    team_id: str
    org_id: str
    path: str  # Acme/platform/gateway


@dataclass(frozen=True, slots=True)
class User:
    id: str
    email: str
    name: str | None
    state: str  # active | suspended | pending (signed up, waiting for approval)
    admin: bool
    created_at: datetime


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A signed-in browser. The token that names it is never kept: only its hash."""

    id: str
    user_id: str
    csrf: str  # sent back in every form; compared with the session's
    created_at: datetime
    last_seen_at: datetime
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Membership:
    user_id: str
    scope: str  # org | team | project
    scope_id: str
    role: str  # member | manager


@dataclass(frozen=True, slots=True)
class LimitRecord:
    """One level's limits. None: the level sets no such limit."""

    scope: str  # org | team | project | user | key | org-member | team-member | project-member
    scope_id: str
    rpm: int | None = None
    tpm: int | None = None
    budget_micros: int | None = None
    period: Literal["day", "month"] = "month"  # the store refuses any other on write
    models: tuple[str, ...] | None = None  # None: no restriction; (): none allowed
    band: str | None = None


@dataclass(frozen=True, slots=True)
class Tree:
    """Organizations, teams and projects by id, with the people in them."""

    orgs: dict[str, Org]
    teams: dict[str, Team]
    projects: dict[str, Project]
    memberships: tuple[Membership, ...] = ()
    users: dict[str, User] = field(default_factory=dict)
    limits: dict[tuple[str, str], LimitRecord] = field(default_factory=dict)

    def reaches(self, user_id: str, project: Project) -> bool:
        """Whether a membership of the person reaches the project (a member of a team or
        an organization may use every project in it)."""
        held = {(m.scope, m.scope_id) for m in self.memberships if m.user_id == user_id}
        return bool(held & {("project", project.id), ("team", project.team_id), ("org", project.org_id)})

    def path_of(self, scope: str, scope_id: str) -> str:
        tables: dict[str, Mapping[str, Org | Team | Project]] = {
            "org": self.orgs,
            "team": self.teams,
            "project": self.projects,
        }
        node = tables[scope].get(scope_id)
        return node.path if node is not None else scope_id


@dataclass(frozen=True, slots=True)
class IssuedKey:
    secret: str
    key: KeyRecord
    project_path: str | None
    owner_email: str | None
    claim_token: str | None = None
    claim_expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class CostRow:
    """Spend since a time, per key and the tree it was spent under (restoring budgets)."""

    key_id: str | None
    user_id: str | None
    project_id: str | None
    team_id: str | None
    org_id: str | None
    cost_micros: int
