"""What the administrator's pages read: the log of limit changes, spend per place in the tree, and
usage in time buckets. Mixed into Store; the log is written by set_limits, in its own transaction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, func, literal, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from .errors import StoreError
from .records import LimitRecord, utcnow
from .schema import limit_changes, usage

# The columns usage is grouped by, by the word the pages use.
USAGE_GROUPS = {
    "org": usage.c.org_id,
    "team": usage.c.team_id,
    "project": usage.c.project_id,
    "person": usage.c.user_id,
}
MAX_BUCKETS = 100  # each is a comparison per row
_LIMIT_FIELDS = ("rpm", "tpm", "budget_micros", "period", "models", "band")


@dataclass(frozen=True, slots=True)
class LimitChange:
    """One change to a level's limits; old or new None: the level had no row then."""

    at: datetime
    changed_by: str | None  # an administrator's email; None: not made on the pages (the CLI)
    scope: str
    scope_id: str
    old: LimitRecord | None
    new: LimitRecord | None


@dataclass(frozen=True, slots=True)
class PlaceSpend:
    """Spend in micro-units by one person (or none) in one project, team and organization (or none)."""

    org_id: str | None
    team_id: str | None
    project_id: str | None
    user_id: str | None
    today: int
    this_month: int
    recent: int  # since the `since` asked for (the last thirty days)


@dataclass(frozen=True, slots=True)
class UsageBucket:
    group_id: str | None
    bucket: int  # 0 is the bucket starting at `since`
    requests: int
    tokens: int
    cost_micros: int
    # tokens split in two, for `llmgw ctl usage`
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _limit_json(rec: LimitRecord | None) -> str | None:
    if rec is None:
        return None
    values: dict[str, Any] = {k: getattr(rec, k) for k in _LIMIT_FIELDS}
    if rec.models is not None:
        values["models"] = list(rec.models)
    return json.dumps(values, sort_keys=True)


def _limit_from_json(scope: str, scope_id: str, text: str | None) -> LimitRecord | None:
    if text is None:
        return None
    values = json.loads(text)
    models = values.get("models")
    return LimitRecord(
        scope=scope,
        scope_id=scope_id,
        rpm=values.get("rpm"),
        tpm=values.get("tpm"),
        budget_micros=values.get("budget_micros"),
        period=values.get("period") or "month",
        models=None if models is None else tuple(models),
        band=values.get("band"),
    )


async def record_limit_change(
    conn: AsyncConnection,
    changed_by: str | None,
    scope: str,
    scope_id: str,
    old: LimitRecord | None,
    new: LimitRecord | None,
) -> None:
    """Log a change inside the transaction that makes it; a write that changed nothing is not logged."""
    before, after = _limit_json(old), _limit_json(new)
    if before == after:
        return
    await conn.execute(
        limit_changes.insert().values(
            at=utcnow(), changed_by=changed_by, scope=scope, scope_id=scope_id, old=before, new=after
        )
    )


class ReportsMixin:
    """Store methods for the administrator's pages: reading, never writing, except the log."""

    _engine: AsyncEngine

    async def limit_changes(self, limit: int = 20) -> list[LimitChange]:
        """The newest changes to limits first."""
        if limit < 1:
            raise StoreError(f"The number of changes must be at least 1, not {limit}.")
        q = select(limit_changes).order_by(limit_changes.c.at.desc(), limit_changes.c.id.desc()).limit(limit)
        async with self._engine.connect() as conn:
            return [
                LimitChange(
                    r.at,
                    r.changed_by,
                    r.scope,
                    r.scope_id,
                    _limit_from_json(r.scope, r.scope_id, r.old),
                    _limit_from_json(r.scope, r.scope_id, r.new),
                )
                for r in await conn.execute(q)
            ]

    async def spend_by_place(self, since: datetime, day_start: datetime, month_start: datetime) -> list[PlaceSpend]:
        """Spend per (organization, team, project, person) today, this month and since `since`, read
        from the usage table (budgets' days and months are UTC, as the gateway counts them)."""
        start = min(since, day_start, month_start)
        cols = (usage.c.org_id, usage.c.team_id, usage.c.project_id, usage.c.user_id)

        def since_(t: datetime) -> ColumnElement[Any]:
            return func.coalesce(func.sum(case((usage.c.at >= t, usage.c.cost_micros), else_=0)), 0)

        q = (
            select(
                *cols,
                since_(day_start).label("today"),
                since_(month_start).label("month"),
                since_(since).label("recent"),
            )
            .where(usage.c.at >= start, usage.c.cost_micros > 0)
            .group_by(*cols)
        )
        async with self._engine.connect() as conn:
            return [
                PlaceSpend(r.org_id, r.team_id, r.project_id, r.user_id, int(r.today), int(r.month), int(r.recent))
                for r in await conn.execute(q)
            ]

    async def usage_buckets(
        self, group: str, since: datetime, until: datetime, width: float, *, org_id: str | None = None
    ) -> list[UsageBucket]:
        """Requests, tokens and spend from `since` to before `until` in buckets of `width` seconds, per
        organization, team, project or person (`group`); only buckets that have any are returned. With
        `org_id`, only the usage in that organization's projects."""
        column = USAGE_GROUPS.get(group)
        if column is None:
            raise StoreError(f"Usage is grouped by {', '.join(USAGE_GROUPS)}, not {group!r}.")
        if width <= 0 or (until - since).total_seconds() / width > MAX_BUCKETS:
            raise StoreError(f"Give a bucket width above 0 that makes at most {MAX_BUCKETS} buckets.")
        # The bucket of each row by comparing its time with each bucket's end, as the window itself is
        # compared: exact on both backends, where arithmetic on timestamps is not the same (nor exact).
        count = math.ceil((until - since).total_seconds() / width)
        ends = [since + timedelta(seconds=width * (i + 1)) for i in range(count - 1)]
        bucket = (
            case(*((usage.c.at < end, i) for i, end in enumerate(ends)), else_=count - 1) if ends else literal(0)
        ).label("bucket")
        q = (
            select(
                column.label("group_id"),
                bucket,
                func.count().label("requests"),
                func.coalesce(func.sum(usage.c.prompt_tokens + usage.c.completion_tokens), 0).label("tokens"),
                func.coalesce(func.sum(usage.c.cost_micros), 0).label("cost"),
                func.coalesce(func.sum(usage.c.prompt_tokens), 0).label("prompt"),
                func.coalesce(func.sum(usage.c.completion_tokens), 0).label("completion"),
            )
            .where(usage.c.at >= since, usage.c.at < until)
            .group_by(column, bucket)
        )
        if org_id is not None:
            q = q.where(usage.c.org_id == org_id)
        async with self._engine.connect() as conn:
            return [
                UsageBucket(
                    r.group_id,
                    int(r.bucket),
                    int(r.requests),
                    int(r.tokens),
                    int(r.cost),
                    int(r.prompt),
                    int(r.completion),
                )
                for r in await conn.execute(q)
            ]
