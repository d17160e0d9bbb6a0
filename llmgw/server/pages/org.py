"""The Organization page (/org): an organization as its managers see it. Read-only.

* For a manager, the organizations they manage; for an administrator, every organization (with none,
  a page saying so and where to make one). Anyone else gets 403 with a sentence. More than one: pills
  to choose (``?org=ID``).
* **Teams and projects** with their limits as the Quotas page shows them (own values, and what binds
  from above, muted with "↑") and the spend of the last thirty days; a budget with its meter.
* **Members**, each once, with every place in the organization they belong (and "manager").
* **Usage over time** by team, project or person (``?by=``), over a window (``?window=``), measured in
  requests, tokens or spend (``?measure=``): only what was spent in the organization's projects.

Read with the queries the Quotas and Usage pages use: ``Store.tenancy_snapshot`` for the tree and its
limits, ``Store.spend_by_place`` for spend, ``Store.usage_buckets`` (with ``org_id``) for usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from aiohttp import web

from llmgw.server.gateway.limits import Pricing
from llmgw.server.pages.admin_format import money
from llmgw.server.pages.admin_limits import (
    MEMBER_OF,
    RECENT_DAYS,
    Level,
    build_levels,
    fill_cells,
    fill_spend,
    recent_spends,
)
from llmgw.server.pages.admin_usage import over_time
from llmgw.server.pages.session import current
from llmgw.server.pages.site import Site
from llmgw.store import Org, Tree, User
from llmgw.store.reports import PlaceSpend

if TYPE_CHECKING:
    from llmgw.server.app import Server

PATH = "/org"
GROUPS = {"team": "team", "project": "project", "person": "person"}
DEFAULT_GROUP = "team"
DEFAULT_WINDOW = "30d"
NOT_A_MANAGER = (
    "This page is for the managers of an organization, and you manage none. An administrator makes a member "
    "an organization's manager on People (the star beside their name)."
)


def org_of(tree: Tree, level: Level) -> str | None:
    """The organization a row of the limits tree belongs to."""
    scope = MEMBER_OF.get(level.scope, level.scope)
    if scope == "org":
        return level.id
    if scope == "team":
        team = tree.teams.get(level.id)
        return team.org_id if team is not None else None
    if scope == "project":
        proj = tree.projects.get(level.id)
        return proj.org_id if proj is not None else None
    return None


def managed(tree: Tree, user: User) -> list[Org]:
    """The organizations a person may see here: every one for an administrator, else those they manage."""
    if user.admin:
        orgs = list(tree.orgs.values())
    else:
        ids = {
            m.scope_id for m in tree.memberships if m.user_id == user.id and m.scope == "org" and m.role == "manager"
        }
        orgs = [o for o in tree.orgs.values() if o.id in ids]
    return sorted(orgs, key=lambda o: (o.name.lower(), o.id))


@dataclass
class Row:
    level: Level
    recent: int | None  # spend of the last thirty days (None on a per-member level)


@dataclass
class Place:
    path: str
    what: str  # organization, team, project
    manager: bool


@dataclass
class Member:
    user: User
    places: list[Place] = field(default_factory=list)
    recent: int = 0

    @property
    def manager(self) -> bool:
        return any(p.manager for p in self.places)


def members(tree: Tree, org: Org, spends: list[PlaceSpend]) -> list[Member]:
    """Everyone in the organization, its teams or its projects, each once with every place they belong."""
    out: dict[str, Member] = {}
    words = {"org": "organization", "team": "team", "project": "project"}
    for m in tree.memberships:
        user = tree.users.get(m.user_id)
        if user is None:
            continue
        if m.scope == "org":
            inside = m.scope_id == org.id
        elif m.scope == "team":
            inside = (t := tree.teams.get(m.scope_id)) is not None and t.org_id == org.id
        else:
            inside = (p := tree.projects.get(m.scope_id)) is not None and p.org_id == org.id
        if inside:
            member = out.setdefault(user.id, Member(user))
            member.places.append(Place(tree.path_of(m.scope, m.scope_id), words[m.scope], m.role == "manager"))
    for s in spends:
        if s.org_id == org.id and s.user_id in out:
            out[s.user_id].recent += s.recent
    for member in out.values():
        member.places.sort(key=lambda p: (p.path.count("/"), p.path.lower()))
    return sorted(out.values(), key=lambda m: (not m.manager, m.user.email))


def rows(tree: Tree, org: Org, spends: list[PlaceSpend]) -> list[Row]:
    """The organization's levels of the limits tree (itself, its teams and projects, and any per-member
    level that sets something), each with its limits, its budget's spend and its last thirty days'."""
    column = {"org": "org_id", "team": "team_id", "project": "project_id"}
    out = []
    levels, _ = build_levels(tree)
    for level in levels:
        if org_of(tree, level) != org.id:
            continue
        fill_cells(tree, level)
        fill_spend(tree, level, spends)
        recent = None
        if level.scope in column:
            recent = sum(s.recent for s in spends if getattr(s, column[level.scope]) == level.id)
        out.append(Row(level, recent))
    return out


class OrgPage:
    def __init__(self, site: Site, server: Server) -> None:
        self.site = site
        self.server = server

    def add_routes(self) -> None:
        self.site.menu.add("Organizations", PATH, "manager")
        self.site.route("GET", PATH, "session", self.page)

    async def page(self, request: web.Request) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None and self.server.store is not None
        store = self.server.store
        tree = await store.tenancy_snapshot()
        orgs = managed(tree, visitor.user)
        if not orgs:
            if not visitor.user.admin:
                return self.site.refuse(request, 403, NOT_A_MANAGER)
            return self.site.render.page(request, "org.html", org=None, orgs=[])
        q = request.query
        wanted = q.get("org", "")
        org = next((o for o in orgs if o.id == wanted), None) if wanted else orgs[0]
        if org is None:
            return self.site.refuse(
                request, 404, "There is no such organization among those you may see here; choose one on /org."
            )
        spends = [s for s in await recent_spends(store, datetime.now(UTC)) if s.org_id == org.id]
        priced = Pricing.from_config(self.server.config.auth).anything_priced()
        u = await over_time(
            store,
            tree,
            q,
            priced=priced,
            groups=GROUPS,
            default_window=DEFAULT_WINDOW,
            default_group=DEFAULT_GROUP,
            org_id=org.id,
        )

        def link(**change: str) -> str:
            params = {"org": org.id, "window": u.window.key, "by": u.by, "measure": u.measure, **change}
            return PATH + "?" + urlencode(params)

        return self.site.render.page(
            request,
            "org.html",
            org=org,
            orgs=orgs,
            rows=rows(tree, org, spends),
            members=members(tree, org, spends),
            priced=priced,
            recent_days=RECENT_DAYS,
            money=money,
            u=u,
            link=link,
        )
