"""Who a request is from, and the pools of limits it is held to.

Shared by the key cache (which builds principals from the store's tenancy tree),
the accountant (which enforces the pools) and admission (which reads the band).

Pool keys name the counter a limit is enforced on; every level that sets a
limit is its own pool:

    key:ID                    the key's own limits
    default:KEY_ID            the cluster defaults (auth.default_rpm/tpm), owned by the key
    project:ID, team:ID, org:ID
    project-member:ID:USER    a per-member limit of a project (team-member, org-member likewise)
    user:ID                   one pool across all of a person's keys
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

Period = Literal["day", "month"]
BANDS = ("low", "normal", "high")  # lowest first: held first and shed first when a pool is full
DEFAULT_BAND = "normal"


@dataclass(frozen=True, slots=True)
class Pool:
    """One level's limits and the counter they are kept in. None: this level sets no such limit."""

    key: str
    rpm: int | None = None
    tpm: int | None = None
    budget_micros: int | None = None  # per period; whole units x 1e6
    period: Period = "month"

    @property
    def scope(self) -> str:
        return self.key.split(":", 1)[0]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from, as far as this gateway needs to know."""

    key_id: str | None
    key_prefix: str | None
    project: str | None  # the project's path, for people (Acme/platform/gateway)
    expires_at: datetime | None = None
    project_id: str | None = None
    team_id: str | None = None
    org_id: str | None = None
    user_id: str | None = None  # the key's owner, if a person
    band: str = DEFAULT_BAND
    pools: tuple[Pool, ...] = ()  # every level that sets a rate or budget limit, key first
    # The models this key may use: the intersection of every allow-list on its
    # chain; None where no level restricts.
    models: frozenset[str] | None = field(default=None)

    @property
    def tenant(self) -> str:
        """Whose turn it is in a fair queue: the project, else the person, else the key."""
        return self.project_id or self.user_id or self.key_id or "anonymous"


ANONYMOUS = Principal(key_id=None, key_prefix=None, project=None)
