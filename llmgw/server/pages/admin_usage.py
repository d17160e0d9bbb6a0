"""The administrator's Usage page (/admin/usage): requests, tokens and spend over a chosen window.

* The window (the last hour, 24 hours, 7 days or 30 days), the grouping (organization, team, project or
  person) and the measure the bars and charts show are links, so the page works without script.
* A table of every group with the window's totals; ranked bars (an HTML grid, labels ellipsised) of the
  measure; and for each of the top groups a bar chart of the measure over gap-filled time buckets,
  drawn on the server as inline SVG (no script), its caption giving the group's total.
* Spend is left out, with a sentence saying why, when no model has a price.
* Read from the usage table (one row per request that reached an engine), grouped in SQL by
  ``Store.usage_buckets``; a person's requests through the chat page count as theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from aiohttp import web
from multidict import MultiMapping

from llmgw.server.gateway.limits import Pricing
from llmgw.server.pages.admin_format import money
from llmgw.server.pages.site import Site
from llmgw.store import Store, Tree

if TYPE_CHECKING:
    from llmgw.server.app import Server

PATH = "/admin/usage"


@dataclass(frozen=True)
class Window:
    key: str
    words: str  # "the last hour"
    seconds: int
    bucket: int  # seconds per bucket
    bucket_words: str  # "5 minutes"


WINDOWS = {
    w.key: w
    for w in (
        Window("1h", "the last hour", 3600, 300, "5 minutes"),
        Window("24h", "the last 24 hours", 86400, 3600, "hour"),
        Window("7d", "the last 7 days", 7 * 86400, 6 * 3600, "6 hours"),
        Window("30d", "the last 30 days", 30 * 86400, 86400, "day"),
    )
}
DEFAULT_WINDOW = "24h"
GROUPS = {"org": "organization", "team": "team", "project": "project", "person": "person"}
DEFAULT_GROUP = "project"
MEASURES = {"requests": "requests", "tokens": "tokens", "spend": "spend"}
DEFAULT_MEASURE = "requests"
RANKED = 20  # bars in the ranked list
CHARTS = 8  # groups with a chart of their own
CHART_H = 60  # the chart's height in SVG units; a bucket is 10 wide


def amount(measure: str, value: int) -> str:
    return money(value) if measure == "spend" else f"{value:,}"


@dataclass
class Group:
    id: str | None
    label: str
    title: str  # a longer description, for hover
    requests: int = 0
    tokens: int = 0
    spend: int = 0
    series: dict[str, list[int]] = field(default_factory=dict)
    is_path: bool = False  # the label is a path in the tree (ORG/TEAM/PROJECT), not an email

    @property
    def parts(self) -> list[str]:
        """The path's names, so the page can let a long one wrap after each "/" (names hold none)."""
        return self.label.split("/") if self.is_path else [self.label]

    @property
    def short(self) -> str:
        """A project as TEAM/PROJECT: in a narrow label its own name shows before the ellipsis."""
        return "/".join(self.parts[-2:])

    def total(self, measure: str) -> int:
        return {"requests": self.requests, "tokens": self.tokens, "spend": self.spend}[measure]


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    title: str


@dataclass(frozen=True)
class Chart:
    group: Group
    total: str
    peak: str
    width: int  # the SVG's width in its units
    bars: list[Bar]


def group_label(tree: Tree, group: str, ident: str | None) -> tuple[str, str]:
    """(label, hover text) of one group; names typed by people are escaped by the template."""
    if group == "org":
        if ident is None:
            return "no organization", "keys outside the tree and personal use"
        org = tree.orgs.get(ident)
        return (org.name, f"organization {org.name}") if org else (ident, "an organization since removed")
    if group == "team":
        if ident is None:
            return "no team", "keys outside the tree and personal use"
        team = tree.teams.get(ident)
        return (team.path, f"team {team.path}") if team else (ident, "a team since removed")
    if group == "project":
        if ident is None:
            return "personal", "personal keys, the chat page on one's own, and keys outside the tree"
        proj = tree.projects.get(ident)
        return (proj.path, f"project {proj.path}") if proj else (ident, "a project since removed")
    if ident is None:
        return "no person", "operators' keys, which belong to no one"
    person = tree.users.get(ident)
    if person is None:
        return ident, "an account since removed"
    return person.email, f"{person.email}{f' ({person.name})' if person.name else ''}, through a key or the chat page"


def _time(at: datetime, window: Window) -> str:
    return f"{at:%H:%M}" if window.seconds <= 86400 else f"{at:%d %b %H:%M}"


def chart(group: Group, measure: str, window: Window, since: datetime) -> Chart:
    values = group.series[measure]
    top = max(values) or 1
    bars = []
    for i, v in enumerate(values):
        h = 0.0 if v == 0 else max(CHART_H * v / top, 1.5)  # a bucket with anything is visible
        start = since + timedelta(seconds=i * window.bucket)
        bars.append(Bar(i * 10 + 1, CHART_H - h, 8, h, f"{_time(start, window)} UTC: {amount(measure, v)}"))
    return Chart(group, amount(measure, group.total(measure)), amount(measure, max(values)), len(values) * 10, bars)


@dataclass
class OverTime:
    """Usage over a window, grouped and counted per time bucket: what the Usage page shows for the whole
    gateway and the Organization page for one organization (``_macros.html``'s usage macros draw it)."""

    window: Window
    groups: dict[str, str]  # the groupings the page offers: key -> word
    by: str
    measure: str
    priced: bool
    since: datetime
    rows: list[Group]  # every group, most requests first
    ranked: list[Group]  # every group, most of the measure first
    totals: Group
    charts: list[Chart]
    more_charts: int  # groups with some of the measure but no chart of their own
    chart_h: int = CHART_H

    @property
    def windows(self) -> list[Window]:
        return list(WINDOWS.values())

    @property
    def measures(self) -> list[str]:
        return [m for m in MEASURES if self.priced or m != "spend"]

    @property
    def start(self) -> str:
        """The charts' first bucket, under their left end."""
        return _time(self.since, self.window)


async def over_time(
    store: Store,
    tree: Tree,
    query: MultiMapping[str],
    *,
    priced: bool,
    groups: dict[str, str],
    default_window: str,
    default_group: str,
    org_id: str | None = None,
) -> OverTime:
    """The window, grouping and measure the query asks for (else the page's defaults; spend only where
    something is priced), and the usage table's buckets for them, in one organization's projects when
    ``org_id`` is given."""
    window = WINDOWS.get(query.get("window", ""), WINDOWS[default_window])
    by = query.get("by", "") if query.get("by", "") in groups else default_group
    measure = query.get("measure", "") if query.get("measure", "") in MEASURES else DEFAULT_MEASURE
    if measure == "spend" and not priced:
        measure = DEFAULT_MEASURE
    now = datetime.now(UTC)
    since = now - timedelta(seconds=window.seconds)
    n = window.seconds // window.bucket
    found: dict[str | None, Group] = {}
    for b in await store.usage_buckets(by, since, now, window.bucket, org_id=org_id):
        g = found.get(b.group_id)
        if g is None:
            label, title = group_label(tree, by, b.group_id)
            g = found[b.group_id] = Group(
                b.group_id,
                label,
                title,
                series={m: [0] * n for m in MEASURES},
                is_path=by in ("team", "project"),
            )
        i = b.bucket
        g.requests += b.requests
        g.tokens += b.tokens
        g.spend += b.cost_micros
        g.series["requests"][i] += b.requests
        g.series["tokens"][i] += b.tokens
        g.series["spend"][i] += b.cost_micros
    ranked = sorted(found.values(), key=lambda g: (-g.total(measure), g.label))
    totals = Group(None, "total", "", sum(g.requests for g in ranked), sum(g.tokens for g in ranked))
    totals.spend = sum(g.spend for g in ranked)
    return OverTime(
        window=window,
        groups=groups,
        by=by,
        measure=measure,
        priced=priced,
        since=since,
        rows=sorted(found.values(), key=lambda g: (-g.requests, g.label)),
        ranked=ranked,
        totals=totals,
        charts=[chart(g, measure, window, since) for g in ranked[:CHARTS] if g.total(measure)],
        more_charts=max(len([g for g in ranked if g.total(measure)]) - CHARTS, 0),
    )


class UsagePage:
    def __init__(self, site: Site, server: Server) -> None:
        self.site = site
        self.server = server

    def add_routes(self) -> None:
        self.site.menu.add("Usage", PATH, "admin")
        self.site.route("GET", PATH, "admin", self.page)

    async def page(self, request: web.Request) -> web.StreamResponse:
        store = self.server.store
        assert store is not None
        u = await over_time(
            store,
            await store.tree(people=True),
            request.query,
            priced=Pricing.from_config(self.server.config.auth).anything_priced(),
            groups=GROUPS,
            default_window=DEFAULT_WINDOW,
            default_group=DEFAULT_GROUP,
        )
        top = u.ranked[0].total(u.measure) if u.ranked else 0
        bars = [
            (g, amount(u.measure, g.total(u.measure)), 100.0 * g.total(u.measure) / top if top else 0.0)
            for g in u.ranked[:RANKED]
        ]

        def link(**change: str) -> str:
            return PATH + "?" + urlencode({"window": u.window.key, "by": u.by, "measure": u.measure, **change})

        return self.site.render.page(
            request,
            "admin_usage.html",
            u=u,
            bars=bars,
            more_bars=max(len(u.ranked) - RANKED, 0),
            since=f"{u.since:%Y-%m-%d %H:%M} UTC",
            money=money,
            link=link,
        )
