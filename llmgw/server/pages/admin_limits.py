"""The administrator's Quotas page (/admin/quotas): the limits on every level of the tree and on people.

* Every organization, team and project is listed whether or not it sets a limit, then every person;
  a per-member level ("each member of …") is listed once it sets something, and opened from its
  organization, team or project. Each row shows the level's rpm, tpm, budget and period, allowed
  models and band as the store holds them, and what it inherits (muted, "↑", with where it comes from).
* Spend beside each budget is of the budget's period (UTC day or month, as the gateway counts it) with
  a meter, red past 90%; without a budget, the last thirty days.
* ``?edit=scope:id`` opens the row's form (htmx swaps only that row in; without script the link loads
  the page with it open). A blank field is no limit of that kind; clearing every field removes the row.
  The save goes through ``Store.set_limits``, the call ``llmgw keys limits`` makes, so it bumps the keys
  generation every gateway polls; this gateway reloads its keys at once, so the next request is held
  to the change. Every change is logged with who made it and the row before it.
* Per-key limits are not set here: ``llmgw keys limits --scope key`` sets them.

The Usage page (admin_usage.py) is added with this one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmgw.server.gateway.limits import Pricing
from llmgw.server.pages import PageError, admin_format
from llmgw.server.pages.admin_usage import UsagePage
from llmgw.server.pages.session import current, redirect
from llmgw.server.pages.site import Site
from llmgw.store import LimitRecord, Org, Project, Store, StoreError, Team, Tree
from llmgw.store.reports import LimitChange, PlaceSpend

if TYPE_CHECKING:
    from llmgw.server.app import Server

PATH = "/admin/quotas"
MICROS = 1_000_000
BANDS = ("low", "normal", "high")
NODE_SCOPES = ("org", "team", "project")
MEMBER_OF = {"org-member": "org", "team-member": "team", "project-member": "project"}
EDITABLE = (*NODE_SCOPES, *MEMBER_OF, "user")
RECENT_DAYS = 30
METER_RED = 0.9
MAX_RATE = 2**31 - 1  # the store's integer columns
MAX_BUDGET_UNITS = 1_000_000  # from here the CLI asks for --allow-large-budget
CHANGES_SHOWN = 20
KEY_REFUSAL = (
    "Per-key limits are set with the command line only: llmgw keys limits --scope key --id KEY-ID (--rpm, --tpm, "
    "--budget, --period, --models, --band, or --clear)."
)
_REF = re.compile(r"([a-z-]{3,16}):([A-Za-z0-9_.@+-]{1,320})")


# -- formatting ---------------------------------------------------------------------


def money(micros: int) -> str:
    """Whole units with two decimals, or as many (up to six) as the amount needs."""
    if micros % 10_000 == 0:
        return f"{micros / MICROS:,.2f}"
    return f"{Decimal(micros) / MICROS:,.6f}".rstrip("0")


def units(micros: int) -> str:
    """A budget as typed in the form: whole units, no trailing zeros ("20", "0.5")."""
    text = f"{Decimal(micros) / MICROS:.6f}".rstrip("0").rstrip(".")
    return text or "0"


def ago(at: datetime, now: datetime) -> str:
    s = max((now - at).total_seconds(), 0.0)
    if s < 60:
        return "just now"
    for size, word in ((86400, "day"), (3600, "hour"), (60, "minute")):
        if s >= size:
            n = int(s // size)
            return f"{n} {word}{'' if n == 1 else 's'} ago"
    return "just now"


def describe_limits(rec: LimitRecord | None) -> str:
    """A level's row in words, for the log of changes."""
    if rec is None:
        return "no limits"
    parts = []
    if rec.rpm is not None:
        parts.append(f"{rec.rpm:,} requests/min")
    if rec.tpm is not None:
        parts.append(f"{rec.tpm:,} tokens/min")
    if rec.budget_micros is not None:
        parts.append(f"budget {money(rec.budget_micros)} a {rec.period}")
    if rec.models is not None:
        parts.append("models " + (", ".join(rec.models) if rec.models else "none"))
    if rec.band is not None:
        parts.append(f"band {rec.band}")
    return "; ".join(parts) or "no limits"


# -- the levels of the tree -----------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One kind of limit on one row: its own value, what binds from above, and where that comes from."""

    own: str | None = None
    inherited: str | None = None
    source: Source | None = None  # where the inherited value, or what caps the own one, is set
    caps: str | None = None  # the own value is larger than a stricter one above: what caps it


@dataclass(frozen=True)
class Spend:
    micros: int
    over: str  # "today", "this month", "the last 30 days"
    budget: int | None = None
    who: str | None = None  # per-member levels: the member who spent most

    @property
    def ratio(self) -> float | None:
        if self.budget is None:
            return None
        return 1.0 if self.budget <= 0 else self.micros / self.budget

    @property
    def red(self) -> bool:
        r = self.ratio
        return r is not None and r > METER_RED

    @property
    def percent(self) -> str:
        r = self.ratio
        if r is None:
            return ""
        p = r * 100
        return f"{p:.1f}%" if p < 10 else f"{math.floor(p)}%"


@dataclass
class Level:
    scope: str  # as stored: org | team | project | *-member | user | key
    id: str
    label: str  # the node's own name (indented under its parent), a person's email, a key's name
    what: str  # "organization", "team", "project", "each member", "person", "key"
    depth: int
    limit: LimitRecord | None
    above: tuple[tuple[str, str], ...] = ()  # the levels also holding these requests, nearest first
    note: str = ""
    title: str = ""  # the level in full, on hover
    cells: dict[str, Cell] = field(default_factory=dict)
    spend: Spend | None = None

    @property
    def ref(self) -> str:
        return f"{self.scope}:{self.id}"

    @property
    def anchor(self) -> str:
        return "q-" + re.sub(r"[^A-Za-z0-9_-]", "-", self.ref)

    @property
    def node(self) -> bool:
        return self.scope in NODE_SCOPES

    @property
    def member_ref(self) -> str:
        return f"{self.scope}-member:{self.id}"


def level_name(tree: Tree, scope: str, ident: str) -> str:
    """A level in words: "team Acme/platform", "each member of Acme", "ann@example.com"."""
    if scope in NODE_SCOPES:
        word = {"org": "organization", "team": "team", "project": "project"}[scope]
        return f"{word} {tree.path_of(scope, ident)}"
    if scope in MEMBER_OF:
        return f"each member of {tree.path_of(MEMBER_OF[scope], ident)}"
    if scope == "user":
        person = tree.users.get(ident)
        return person.email if person is not None else f"person {ident}"
    return f"{scope} {ident}"


def build_levels(tree: Tree, show_members: Iterable[str] = ()) -> tuple[list[Level], list[Level]]:
    """The tree's rows in order (each node, then its per-member level where it sets something or is
    asked for), and the people's."""
    lims = tree.limits
    wanted = set(show_members)
    rows: list[Level] = []

    def add(scope: str, ident: str, label: str, what: str, depth: int, above: tuple[tuple[str, str], ...]) -> None:
        title = level_name(tree, scope, ident)
        rows.append(Level(scope, ident, label, what, depth, lims.get((scope, ident)), above, title=title))

    def members(scope: str, ident: str, name: str, depth: int, above: tuple[tuple[str, str], ...]) -> None:
        level = f"{scope}-member"
        if (level, ident) in lims or f"{level}:{ident}" in wanted:
            add(level, ident, f"of {name}", "each member", depth, above)

    for org in sorted(tree.orgs.values(), key=lambda o: o.name):
        o = ("org", org.id)
        add("org", org.id, org.name, "organization", 0, ())
        members("org", org.id, org.name, 1, (o,))
        for team in sorted((t for t in tree.teams.values() if t.org_id == org.id), key=lambda t: t.name):
            t = ("team", team.id)
            add("team", team.id, team.name, "team", 1, (o,))
            members("team", team.id, team.name, 2, (t, ("org-member", org.id), o))
            for proj in sorted((p for p in tree.projects.values() if p.team_id == team.id), key=lambda p: p.name):
                p = ("project", proj.id)
                add("project", proj.id, proj.name, "project", 2, (t, o))
                members("project", proj.id, proj.name, 3, (p, ("team-member", team.id), t, ("org-member", org.id), o))
    people = [
        Level(
            "user",
            u.id,
            u.email,
            "person",
            0,
            lims.get(("user", u.id)),
            note=(u.name or "") + ("" if u.state == "active" else f" ({u.state})"),
            title=f"person {u.email}",
        )
        for u in sorted(tree.users.values(), key=lambda u: u.email)
    ]
    return rows, people


@dataclass(frozen=True)
class Source:
    """A level a value comes from: "team platform" to show, "team Acme/platform" on hover."""

    short: str
    full: str


def source(tree: Tree, scope: str, ident: str) -> Source:
    full = level_name(tree, scope, ident)
    if scope in NODE_SCOPES or scope in MEMBER_OF:
        base = MEMBER_OF.get(scope, scope)
        tables: dict[str, Mapping[str, Org | Team | Project]] = {
            "org": tree.orgs,
            "team": tree.teams,
            "project": tree.projects,
        }
        node = tables[base].get(ident)
        if node is not None:
            return Source(full.replace(node.path, node.name) if node.path != node.name else full, full)
    return Source(full, full)


def _joined(sources: list[Source]) -> Source:
    return Source(", ".join(s.short for s in sources), ", ".join(s.full for s in sources))


def _strictest(tree: Tree, above: tuple[tuple[str, str], ...], value: Any) -> tuple[int, Source] | None:
    """The smallest value set above, and the level it is set on."""
    found = [
        (v, source(tree, s, i))
        for s, i in above
        if (lim := tree.limits.get((s, i))) is not None and (v := value(lim)) is not None
    ]
    return min(found, key=lambda f: f[0]) if found else None


def fill_cells(tree: Tree, level: Level) -> None:
    """Each kind's own value, what binds it from above (the strictest level above that sets it: every
    level is its own pool and the strictest wins), and what caps an own value larger than that."""
    lim = level.limit
    for kind in ("rpm", "tpm"):
        own = getattr(lim, kind) if lim is not None else None
        up = _strictest(tree, level.above, lambda r, k=kind: getattr(r, k))
        cell = Cell(own=None if own is None else f"{own:,}")
        if up is not None:
            if own is None:
                cell = Cell(inherited=f"↑ {up[0]:,}", source=up[1])
            elif own > up[0]:
                cell = Cell(own=cell.own, caps=f"capped at {up[0]:,} by {up[1].short}", source=up[1])
        level.cells[kind] = cell
    budget = lim.budget_micros if lim is not None else None
    period = lim.period if lim is not None else "month"
    if budget is not None:
        same = _strictest(tree, level.above, lambda r: r.budget_micros if r.period == period else None)
        cell = Cell(own=f"{money(budget)} a {period}")
        if same is not None and budget > same[0]:
            cell = Cell(own=cell.own, caps=f"capped at {money(same[0])} by {same[1].short}", source=same[1])
        level.cells["budget"] = cell
    else:
        found = [
            (r.budget_micros, r.period, source(tree, s, i))
            for s, i in level.above
            if (r := tree.limits.get((s, i))) is not None and r.budget_micros is not None
        ]
        if found:
            # The strictest, a day's budget counted as thirty of them against a month's.
            b, per, src = min(found, key=lambda f: (f[0] * (30 if f[1] == "day" else 1), f[0]))
            level.cells["budget"] = Cell(inherited=f"↑ {money(b)} a {per}", source=src)
        else:
            level.cells["budget"] = Cell()
    own_models = lim.models if lim is not None else None
    lists = [
        (set(r.models), source(tree, s, i))
        for s, i in level.above
        if (r := tree.limits.get((s, i))) is not None and r.models is not None
    ]
    allowed: set[str] | None = None
    for names, _ in lists:
        allowed = names if allowed is None else allowed & names
    where = _joined([src for _, src in lists])
    if own_models is not None:
        text = ", ".join(own_models) if own_models else "none"
        withheld = sorted(set(own_models) - allowed) if allowed is not None else []
        level.cells["models"] = (
            Cell(own=text, caps=f"{', '.join(withheld)} withheld by {where.short}", source=where)
            if withheld
            else Cell(own=text)
        )
    elif allowed is not None:
        level.cells["models"] = Cell(inherited="↑ " + (", ".join(sorted(allowed)) or "none"), source=where)
    else:
        level.cells["models"] = Cell()
    if level.node:
        own_band = lim.band if lim is not None else None
        if own_band is not None:
            level.cells["band"] = Cell(own=own_band)
        else:
            nearest = next(
                (
                    (r.band, source(tree, s, i))
                    for s, i in level.above
                    if s in NODE_SCOPES and (r := tree.limits.get((s, i))) is not None and r.band is not None
                ),
                None,
            )
            level.cells["band"] = (
                Cell(inherited=f"↑ {nearest[0]}", source=nearest[1])
                if nearest
                else Cell(inherited="normal", source=Source("the default", "the default"))
            )
    else:
        level.cells["band"] = Cell()


async def recent_spends(store: Store, now: datetime) -> list[PlaceSpend]:
    """Spend per place over the last thirty days, today and this month (UTC days and months, as the
    gateway counts budgets): what fill_spend reads, for this page and the Organization page."""
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return await store.spend_by_place(now - timedelta(days=RECENT_DAYS), day, day.replace(day=1))


def fill_spend(tree: Tree, level: Level, spends: list[PlaceSpend]) -> None:
    """The level's spend: of its budget's period where it has a budget, else of the last thirty days."""
    lim = level.limit
    budget = lim.budget_micros if lim is not None else None

    def amount(s: PlaceSpend) -> int:
        if budget is None:
            return s.recent
        return s.today if lim is not None and lim.period == "day" else s.this_month

    over = f"the last {RECENT_DAYS} days"
    if budget is not None and lim is not None:
        over = "today" if lim.period == "day" else "this month"
    column = {"org": "org_id", "team": "team_id", "project": "project_id"}
    if level.scope in NODE_SCOPES:
        total = sum(amount(s) for s in spends if getattr(s, column[level.scope]) == level.id)
        level.spend = Spend(total, over, budget)
    elif level.scope in MEMBER_OF:
        col = column[MEMBER_OF[level.scope]]
        per: dict[str, int] = {}
        for s in spends:
            if s.user_id is not None and getattr(s, col) == level.id:
                per[s.user_id] = per.get(s.user_id, 0) + amount(s)
        if per:
            uid, most = max(per.items(), key=lambda kv: (kv[1], kv[0]))
            level.spend = Spend(most, over, budget, level_name(tree, "user", uid))
        else:
            level.spend = Spend(0, over, budget)
    elif level.scope == "user":
        level.spend = Spend(sum(amount(s) for s in spends if s.user_id == level.id), over, budget)


# -- the form -------------------------------------------------------------------------


class FormProblem(PageError):
    pass


@dataclass
class Edit:
    """What the form holds: as typed (to show it again after a refusal) and as the store takes it."""

    rpm: str = ""
    tpm: str = ""
    budget: str = ""
    period: str = "month"
    models: str = ""
    models_none: bool = False
    band: str = ""

    @classmethod
    def of(cls, rec: LimitRecord | None) -> Edit:
        if rec is None:
            return cls()
        return cls(
            rpm="" if rec.rpm is None else str(rec.rpm),
            tpm="" if rec.tpm is None else str(rec.tpm),
            budget="" if rec.budget_micros is None else units(rec.budget_micros),
            period=rec.period,
            models=", ".join(rec.models) if rec.models else "",
            models_none=rec.models == (),
            band=rec.band or "",
        )

    @classmethod
    def posted(cls, form: Any) -> Edit:
        def text(name: str, most: int = 200) -> str:
            return str(form.get(name, "")).strip()[:most]

        return cls(
            rpm=text("rpm"),
            tpm=text("tpm"),
            budget=text("budget"),
            period=text("period") or "month",
            models=text("models", 4000),
            models_none=bool(form.get("models_none")),
            band=text("band"),
        )


def _rate(name: str, text: str) -> int | None:
    cleaned = text.replace(",", "").replace("_", "").replace(" ", "")
    if not cleaned:
        return None
    if not cleaned.isdigit():
        raise FormProblem(f"{name} is a whole number of 0 or more (blank: no limit), not “{text}”.")
    value = int(cleaned)
    if value > MAX_RATE:
        raise FormProblem(f"{name} is at most {MAX_RATE:,}.")
    return value


def parse_edit(edit: Edit, scope: str) -> dict[str, Any]:
    """The values set_limits takes, every kind given (None: no limit of that kind)."""
    rpm = _rate("Requests per minute", edit.rpm)
    tpm = _rate("Tokens per minute", edit.tpm)
    budget: int | None = None
    if edit.budget:
        try:
            amount = Decimal(edit.budget.replace(",", "").replace("_", "").replace(" ", ""))
        except InvalidOperation:
            raise FormProblem(
                f"The budget is a number of whole units, such as 20 or 2.50, not “{edit.budget}”."
            ) from None
        if not amount.is_finite() or amount < 0:
            raise FormProblem("The budget is a number of whole units of 0 or more (blank: no budget).")
        if amount >= MAX_BUDGET_UNITS:
            raise FormProblem(
                f"A budget of {amount:,} is in whole units, not micro-units; one of a million or more is set with "
                "llmgw keys limits --budget N --allow-large-budget."
            )
        micros = amount * MICROS
        if micros != micros.to_integral_value():
            raise FormProblem("The budget is finer than a millionth of a unit; give at most 6 decimals.")
        budget = int(micros)
    if edit.period not in ("day", "month"):
        raise FormProblem("The budget's period is a day or a month.")
    names = [m.strip() for m in re.split(r"[,\s]+", edit.models) if m.strip()]
    if edit.models_none and names:
        raise FormProblem("Either list the models allowed or allow none, not both.")
    models: list[str] | None = [] if edit.models_none else (names or None)
    band: str | None = edit.band or None
    if band is not None and band not in BANDS:
        raise FormProblem(f"The band is {', '.join(BANDS)}, or blank to inherit.")
    if band is not None and scope not in NODE_SCOPES:
        raise FormProblem("A band is set on an organization, team or project.")
    return {"rpm": rpm, "tpm": tpm, "budget_micros": budget, "period": edit.period, "models": models, "band": band}


def _same(old: LimitRecord | None, new: dict[str, Any]) -> bool:
    before = {
        "rpm": old.rpm if old else None,
        "tpm": old.tpm if old else None,
        "budget_micros": old.budget_micros if old else None,
        "models": sorted(old.models) if old and old.models is not None else None,
        "band": old.band if old else None,
    }
    after = {k: (sorted(set(v)) if k == "models" and v is not None else v) for k, v in new.items() if k != "period"}
    if before != after:
        return False
    # The period matters only beside a budget.
    return new["budget_micros"] is None or (old is not None and old.period == new["period"])


def parse_ref(text: str) -> tuple[str, str] | None:
    m = _REF.fullmatch(text.strip())
    return (m.group(1), m.group(2)) if m else None


# -- the page ---------------------------------------------------------------------------


class LimitsPages:
    def __init__(self, site: Site, server: Server) -> None:
        self.site = site
        self.server = server

    def add_routes(self) -> None:
        self.site.menu.add("Quotas", PATH, "admin")
        self.site.route("GET", PATH, "admin", self.page)
        self.site.route("POST", PATH, "admin", self.save)
        UsagePage(self.site, self.server).add_routes()

    @property
    def store(self):  # the Server opens it before it builds its pages
        assert self.server.store is not None
        return self.server.store

    async def _render(
        self,
        request: web.Request,
        *,
        status: int = 200,
        editing: str | None = None,
        edit: Edit | None = None,
        problem: str = "",
        saved: str = "",
    ) -> web.Response:
        tree = await self.store.tenancy_snapshot()
        now = datetime.now(UTC)
        spends = await recent_spends(self.store, now)
        rows, people = build_levels(tree, [editing] if editing else [])
        keys = {k.id: k for k in await self.store.list_keys()}
        key_rows = [
            Level(
                "key",
                lim.scope_id,
                keys[lim.scope_id].name if lim.scope_id in keys else lim.scope_id,
                "key",
                0,
                lim,
                note=lim.scope_id,
                title=f"key {lim.scope_id}",
            )
            for (scope, _), lim in sorted(tree.limits.items())
            if scope == "key"
        ]
        for level in (*rows, *people, *key_rows):
            fill_cells(tree, level)
            fill_spend(tree, level, spends)
        open_level = next((lv for lv in (*rows, *people) if lv.ref == editing), None)
        if editing and open_level is None and not problem:
            status, problem = 404, f"There is no {editing} to edit; the tree may have changed. Pick a row below."
        if open_level is not None and edit is None:
            edit = Edit.of(open_level.limit)
        changes = await self.store.limit_changes(CHANGES_SHOWN)
        return self.site.render.page(
            request,
            "admin_quotas.html",
            status,
            rows=rows,
            people=people,
            key_rows=key_rows,
            editing=open_level.ref if open_level is not None else "",
            edit=edit or Edit(),
            problem=problem,
            saved=saved,
            priced=Pricing.from_config(self.server.config.auth).anything_priced(),
            changes=[self._change(tree, c, now) for c in changes],
            bands=BANDS,
            recent_days=RECENT_DAYS,
            member_refs={lv.ref for lv in rows if lv.scope in MEMBER_OF},
            money=admin_format.money,  # spend to the cent; money() here is a budget as it was set
        )

    @staticmethod
    def _change(tree: Tree, c: LimitChange, now: datetime) -> dict[str, str]:
        return {
            "when": ago(c.at, now),
            "at": f"{c.at:%Y-%m-%d %H:%M:%S} UTC",
            "who": c.changed_by or "the command line",
            "level": level_name(tree, c.scope, c.scope_id),
            "old": describe_limits(c.old),
            "new": describe_limits(c.new),
        }

    async def page(self, request: web.Request) -> web.StreamResponse:
        want = request.query.get("edit", "")
        saved = request.query.get("saved", "")
        if not want:
            tree_saved = ""
            if saved and parse_ref(saved) is not None:
                scope, ident = parse_ref(saved) or ("", "")
                tree_saved = level_name(await self.store.tenancy_snapshot(), scope, ident)
            return await self._render(request, saved=tree_saved)
        ref = parse_ref(want)
        if ref is not None and ref[0] == "key":
            return await self._render(request, status=400, problem=KEY_REFUSAL)
        if ref is None or ref[0] not in EDITABLE:
            return await self._render(request, status=400, problem="That is not a row of this page; pick one below.")
        return await self._render(request, editing=f"{ref[0]}:{ref[1]}")

    async def save(self, request: web.Request) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        form = await request.post()
        ref = parse_ref(str(form.get("level", "")))
        if ref is not None and ref[0] == "key":
            return await self._render(request, status=400, problem=KEY_REFUSAL)
        if ref is None or ref[0] not in EDITABLE:
            return await self._render(request, status=400, problem="That is not a row of this page; pick one below.")
        scope, ident = ref
        editing = f"{scope}:{ident}"
        edit = Edit.posted(form)
        base = MEMBER_OF.get(scope, scope)
        per_member = scope in MEMBER_OF
        old = await self.store.get_limits(scope, ident)
        try:
            if form.get("clear"):
                if old is not None:
                    await self.store.set_limits(
                        base, ident, per_member=per_member, clear=True, changed_by=visitor.user.email
                    )
            else:
                values = parse_edit(edit, scope)
                if old is not None and values["budget_micros"] is None:
                    values["period"] = old.period  # a period without a budget changes nothing
                if not _same(old, values):
                    await self.store.set_limits(
                        base, ident, per_member=per_member, changed_by=visitor.user.email, **values
                    )
        except (FormProblem, StoreError) as exc:
            return await self._render(request, status=400, editing=editing, edit=edit, problem=str(exc))
        await self._take_effect()
        anchor = Level(scope, ident, "", "", 0, None).anchor
        return redirect(request, f"{PATH}?saved={editing}#{anchor}")

    async def _take_effect(self) -> None:
        """set_limits bumped the keys generation (every gateway on the store reloads within its poll);
        this one reloads now, so the very next request is held to the change."""
        if self.server.keys is not None:
            await self.server.keys.load()
