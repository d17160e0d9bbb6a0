"""The account page (/profile, "Account" in the menu): the person's keys, their own use and budgets, a
password change, and "Connect your editor"; and the open ``GET /setup/<tool>`` script it points curl at.

* Keys are the person's own (issued with them as owner), in one of their projects or personal, the same
  choices the chat page offers. A new key's secret is on the page that answers the POST that made it and
  nowhere else: the store keeps only its hash, and every page is sent ``Cache-Control: no-store``. Revoking
  takes a key id and refuses one that is not the person's.
* Own use: the last thirty days of the usage table rows recorded as theirs (through their keys, and through
  the chat page as ``session:<user id>``), with tokens per day. Budgets: every pool with a budget that a
  principal of theirs would be held to, in each place they can spend (built as the chat page builds it), its
  spend summed from the usage table from the start of its period with the store's ``usage_cost_since``.
* A password change asks for the current one, ends every other session of theirs and rotates this one's CSRF
  token; the page answering it (and its menu's sign-out form) already carries the new token.
* Every form posts to /profile itself (``do`` says which), so the page that answers is still the account page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

from aiohttp import web
from sqlalchemy import func, select

from llmgw.server.gateway.auth import person_principal
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.pages import setup_scripts
from llmgw.server.pages.admin_format import money
from llmgw.server.pages.chat import ChatPage, Choice, spend_choices
from llmgw.server.pages.session import VISITOR, Visitor, current
from llmgw.server.pages.signin_limit import SigninUnavailable, wait_text
from llmgw.server.pages.site import MIN_PASSWORD, Site, base_url, client_address
from llmgw.store import CostRow, KeyRecord, NotFound, StoreError, Tree
from llmgw.store.schema import usage

USE_DAYS = 30
EXPIRY_CHOICES = (("", "never"), ("30", "in 30 days"), ("90", "in 90 days"), ("365", "in a year"))
AMBER_AT = 0.8  # a budget bar turns amber past four-fifths, red when spent


# -- formatting ------------------------------------------------------------------------------------------


def relative(at: datetime | None, now: datetime) -> str:
    """ "3 hours ago", "in 29 days", "just now"; "never" for no time."""
    if at is None:
        return "never"
    s = (at - now).total_seconds()
    future, s = s > 0, abs(s)
    if s < 60:
        return "just now" if not future else "in a minute"
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= size:
            n = int(s // size)
            text = f"{n} {unit}{'' if n == 1 else 's'}"
            return f"in {text}" if future else f"{text} ago"
    return "just now"  # unreachable: s >= 60 matched "minute"


def percent(fraction: float) -> str:
    """Under ten a percent keeps a decimal."""
    p = fraction * 100
    return f"{p:.1f}%" if p < 10 else f"{p:.0f}%"


# -- what the page shows -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyRow:
    id: str
    name: str
    where: str  # a project's path, or "personal"
    prefix: str
    created: str
    created_at: datetime
    last_used: str
    expires: str
    expired: bool


@dataclass(frozen=True)
class Day:
    day: str
    requests: int
    tokens: int
    share: float  # of the busiest day's tokens, for its bar


@dataclass(frozen=True)
class Use:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_micros: int
    days: tuple[Day, ...]

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Budget:
    pool: str
    label: str
    period: str  # day | month
    budget_micros: int
    spent_micros: int
    places: tuple[str, ...]  # where it applies: project paths and "personal"

    @property
    def fraction(self) -> float:
        return self.spent_micros / self.budget_micros if self.budget_micros else math.inf

    @property
    def state(self) -> str:
        """ "spent" (red), "amber" past four-fifths, else "ok"."""
        return "spent" if self.fraction >= 1 else "amber" if self.fraction >= AMBER_AT else "ok"

    @property
    def shown(self) -> dict[str, Any]:
        frac = self.fraction
        return {
            "value": min(self.spent_micros, self.budget_micros),
            "max": max(self.budget_micros, 1),
            "low": int(self.budget_micros * AMBER_AT),
            "high": max(self.budget_micros - 1, 0),
            "text": f"{money(self.spent_micros)} of {money(self.budget_micros)} "
            f"{'today' if self.period == 'day' else 'this month'}"
            + (f" ({percent(frac)})" if math.isfinite(frac) else ""),
        }


def period_start(period: str, now: datetime) -> datetime:
    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today if period == "day" else today.replace(day=1)


def pool_label(pool: str, tree: Tree, user_id: str) -> str:
    """A budget pool in words, saying whether it is the person's alone or shared with others."""
    scope, _, ident = pool.partition(":")
    words = {"org": "organization", "team": "team", "project": "project"}
    if scope == "user":
        return "Your own budget, wherever you spend"
    if scope.endswith("-member"):
        level = scope[: -len("-member")]
        owner = ident.rpartition(":")[0]
        return f"Your share in {words.get(level, level)} {tree.path_of(level, owner)} (each member has their own)"
    if scope in words:
        return f"{words[scope].capitalize()} {tree.path_of(scope, ident)}, shared with everyone who spends there"
    return pool


def pool_spent(pool: str, rows: Sequence[CostRow]) -> int:
    """A pool's spend from the usage totals, counted as the accountant counts it (restore())."""
    scope, _, ident = pool.partition(":")
    if scope == "user":
        return sum(r.cost_micros for r in rows if r.user_id == ident)
    if scope == "key":
        return sum(r.cost_micros for r in rows if r.key_id == ident)
    if scope.endswith("-member"):
        level = scope[: -len("-member")]
        owner, _, user = ident.rpartition(":")
        return sum(r.cost_micros for r in rows if getattr(r, f"{level}_id", None) == owner and r.user_id == user)
    if scope in ("project", "team", "org"):
        return sum(r.cost_micros for r in rows if getattr(r, f"{scope}_id") == ident)
    return 0


class ProfilePage:
    def __init__(self, site: Site, gateway: Gateway) -> None:
        self.site = site
        self.gateway = gateway

    def add_routes(self) -> None:
        self.site.menu.add("Account", "/profile")
        self.site.route("GET", "/profile", "session", self.page)
        self.site.route("POST", "/profile", "session", self.act)
        self.site.route("GET", "/setup/{tool}", "open", self.setup_script)

    # -- reading ---------------------------------------------------------------------------------------

    def models(self) -> list[str]:
        """The models the chat page offers, by name."""
        return [str(m["name"]) for m in ChatPage(self.site, self.gateway).models()]

    async def own_keys(self, user_id: str) -> list[KeyRecord]:
        return [k for k in await self.site.store.list_keys(include_revoked=False) if k.user_id == user_id]

    async def own_use(self, user_id: str, now: datetime) -> Use:
        """The person's requests, tokens and spend over the last thirty days, per UTC day."""
        since = now - timedelta(days=USE_DAYS)
        engine = self.site.store.engine
        at = usage.c.at if engine.dialect.name == "sqlite" else func.timezone("UTC", usage.c.at)
        day = func.date(at).label("day")
        q = (
            select(
                day,
                func.count().label("requests"),
                func.coalesce(func.sum(usage.c.prompt_tokens), 0).label("prompt"),
                func.coalesce(func.sum(usage.c.completion_tokens), 0).label("completion"),
                func.coalesce(func.sum(usage.c.cost_micros), 0).label("cost"),
            )
            .where(usage.c.at >= since, usage.c.user_id == user_id)
            .group_by(day)
            .order_by(day)
        )
        async with engine.connect() as conn:
            rows = list(await conn.execute(q))
        busiest = max((int(r.prompt) + int(r.completion) for r in rows), default=0)
        days = tuple(
            Day(
                str(r.day),
                int(r.requests),
                int(r.prompt) + int(r.completion),
                (int(r.prompt) + int(r.completion)) / busiest if busiest else 0.0,
            )
            for r in rows
        )
        return Use(
            requests=sum(int(r.requests) for r in rows),
            prompt_tokens=sum(int(r.prompt) for r in rows),
            completion_tokens=sum(int(r.completion) for r in rows),
            cost_micros=sum(int(r.cost) for r in rows),
            days=tuple(reversed(days)),
        )

    async def budgets(self, user_id: str, tree: Tree, choices: list[Choice], now: datetime) -> list[Budget]:
        """Every budget a principal of the person's would be held to, in each place they can spend."""
        found: dict[str, tuple[int, str, list[str]]] = {}
        auth = self.site.config.auth
        for choice in choices:
            principal = person_principal(user_id, choice.id or None, tree, auth.default_rpm, auth.default_tpm)
            for pool in principal.pools:
                if pool.budget_micros is None:
                    continue
                entry = found.setdefault(pool.key, (pool.budget_micros, pool.period, []))
                entry[2].append(choice.label)
        totals: dict[str, list[CostRow]] = {}
        out = []
        for key, (budget, period, places) in found.items():
            if period not in totals:
                totals[period] = await self.site.store.usage_cost_since(period_start(period, now))
            out.append(
                Budget(
                    key, pool_label(key, tree, user_id), period, budget, pool_spent(key, totals[period]), tuple(places)
                )
            )
        return out

    def _key_rows(self, keys: list[KeyRecord], tree: Tree, now: datetime) -> list[KeyRow]:
        rows = []
        for k in sorted(keys, key=lambda k: k.created_at, reverse=True):
            proj = tree.projects.get(k.project_id or "")
            where = proj.path if proj is not None else (k.project or "personal")
            expired = k.expires_at is not None and k.expires_at <= now
            rows.append(
                KeyRow(
                    id=k.id,
                    name=k.name,
                    where=where,
                    prefix=k.prefix,
                    created=relative(k.created_at, now),
                    created_at=k.created_at,
                    last_used=relative(k.last_used_at, now),
                    expires="never"
                    if k.expires_at is None
                    else ("expired " if expired else "") + relative(k.expires_at, now),
                    expired=expired,
                )
            )
        return rows

    def _origin(self, request: web.Request) -> str:
        return base_url(request).removesuffix("/v1")

    async def _page(self, request: web.Request, status: int = 200, **extra: Any) -> web.Response:
        visitor = current(request)
        assert visitor is not None
        now = datetime.now(UTC)
        me = visitor.user.id
        tree = await self.site.store.tenancy_snapshot()
        choices = spend_choices(tree, me)
        values: dict[str, Any] = {
            "notice": "",
            "problem": "",
            "created": None,
            "editor": None,
            "form": {},
        }
        values.update(extra)
        return self.site.render.page(
            request,
            "profile.html",
            status,
            keys=self._key_rows(await self.own_keys(me), tree, now),
            choices=choices,
            expiry_choices=EXPIRY_CHOICES,
            use=await self.own_use(me, now),
            use_days=USE_DAYS,
            budgets=await self.budgets(me, tree, choices, now),
            models=self.models(),
            tools=[(t, setup_scripts.TOOL_NAMES[t]) for t in setup_scripts.TOOLS],
            base=base_url(request),
            min_password=MIN_PASSWORD,
            money=money,
            **values,
        )

    async def page(self, request: web.Request) -> web.StreamResponse:
        return await self._page(request)

    # -- acting -------------------------------------------------------------------------------------------

    async def act(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        fields = {k: str(v)[:1024] for k, v in form.items() if isinstance(v, str)}
        do = fields.get("do", "")
        if do == "create":
            return await self._create(request, fields)
        if do == "revoke":
            return await self._revoke(request, fields)
        if do == "password":
            return await self._password(request, fields)
        if do == "editor":
            return await self._editor(request, fields)
        return await self._page(request, 400, problem="That form is not one of this page's; reload the page.")

    async def _issue(
        self, visitor: Visitor, name: str, project: str, expires_days: str = ""
    ) -> tuple[str, KeyRecord, str]:
        """A key of the person's, spending against one of their choices; (secret, record, where)."""
        tree = await self.site.store.tenancy_snapshot()
        choices = {c.id: c for c in spend_choices(tree, visitor.user.id)}
        if project not in choices:
            raise StoreError("You cannot spend against that project (any more); choose one of the list.")
        expires_at = None
        if expires_days:
            if not expires_days.isdigit() or expires_days not in {d for d, _ in EXPIRY_CHOICES}:
                raise StoreError("Choose when the key expires from the list.")
            expires_at = datetime.now(UTC) + timedelta(days=int(expires_days))
        issued = await self.site.store.issue_key(
            name, project=project or None, owner=visitor.user.id, expires_at=expires_at
        )
        where = f"the project {choices[project].label}" if project else "your personal use"
        return issued.secret, issued.key, where

    async def _create(self, request: web.Request, fields: dict[str, str]) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        name = fields.get("name", "").strip()
        try:
            secret, key, where = await self._issue(visitor, name, fields.get("project", ""), fields.get("expires", ""))
        except StoreError as exc:
            return await self._page(request, 400, problem=str(exc), form=fields)
        return await self._page(request, created={"secret": secret, "name": key.name, "where": where})

    async def _revoke(self, request: web.Request, fields: dict[str, str]) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        key_id = fields.get("key", "")
        mine = {k.id: k for k in await self.own_keys(visitor.user.id)}
        if key_id not in mine:
            return await self._page(
                request, 404, problem="None of your keys has that id (it may be revoked already); nothing changed."
            )
        try:
            await self.site.store.revoke_key(key_id)
        except StoreError as exc:
            return await self._page(request, 409, problem=str(exc))
        return await self._page(
            request, notice=f"The key {mine[key_id].name} ({mine[key_id].prefix}…) is revoked; it works no more."
        )

    async def _password(self, request: web.Request, fields: dict[str, str]) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        user = visitor.user
        old, new, again = fields.get("current", ""), fields.get("password", ""), fields.get("password2", "")
        if not old:
            return await self._page(request, 400, problem="Give your current password; nothing changed.")
        # Counted before the password is checked, as a sign-in is (signin_limit.py).
        try:
            counted = await self.site.limiter.attempt(user.email, client_address(request))
        except SigninUnavailable as exc:
            return await self._page(request, 503, problem=str(exc))
        if counted.refused:
            wait = wait_text(counted.wait_s)
            page = await self._page(request, 429, problem=f"Too many wrong passwords; try again in {wait} seconds.")
            page.headers["Retry-After"] = wait
            return page
        if not await self.site.store.check_password(user.id, old):
            return await self._page(request, 400, problem="That is not your current password; nothing changed.")
        try:
            await self.site.limiter.right(counted)
        except SigninUnavailable as exc:
            return await self._page(request, 503, problem=str(exc))
        if len(new) < MIN_PASSWORD:
            return await self._page(
                request, 400, problem=f"Choose a new password of at least {MIN_PASSWORD} characters."
            )
        if new != again:
            return await self._page(request, 400, problem="The two new passwords differ; type the same one twice.")
        try:
            await self.site.store.set_password(user.id, new)
        except StoreError as exc:
            return await self._page(request, 400, problem=str(exc))
        ended = await self.site.store.end_sessions(user.id, except_token=visitor.token)
        try:
            csrf = await self.site.store.rotate_csrf(visitor.token)
        except NotFound:
            return self.site.refuse(request, 401, "Your session ended; sign in again with your new password.")
        # The page answering this POST, its forms and its menu's sign-out form, carry the new token.
        request[VISITOR] = replace(visitor, csrf=csrf)
        others = (
            f" {ended} other session{'' if ended == 1 else 's'} of yours {'was' if ended == 1 else 'were'} signed out."
        )
        return await self._page(request, notice="Your password is changed." + (others if ended else ""))

    async def _editor(self, request: web.Request, fields: dict[str, str]) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        tool, model = fields.get("tool", ""), fields.get("model", "")
        if tool not in setup_scripts.TOOLS:
            return await self._page(request, 400, problem="Choose Continue, Codex or Cline.", form=fields)
        if model not in self.models():
            return await self._page(request, 400, problem="Choose one of the models this gateway serves.", form=fields)
        origin = self._origin(request)
        try:
            setup_scripts.check_origin(origin)
        except setup_scripts.Unsafe:
            return await self._page(
                request,
                400,
                problem="The address this page was reached through cannot be written into a configuration.",
                form=fields,
            )
        name = f"{setup_scripts.TOOL_NAMES[tool]} on {datetime.now(UTC):%Y-%m-%d}"
        try:
            secret, key, where = await self._issue(visitor, name, fields.get("project", ""))
        except StoreError as exc:
            return await self._page(request, 400, problem=str(exc), form=fields)
        editor: dict[str, Any] = {
            "tool": tool,
            "name": setup_scripts.TOOL_NAMES[tool],
            "key_name": key.name,
            "where": where,
            "secret": secret,
            "model": model,
            "files": [],
            "fields": [],
            "command": "",
            "run": setup_scripts.run_after(tool),
        }
        if tool == "cline":
            editor["fields"] = setup_scripts.cline_fields(origin, model)
        else:
            editor["files"] = setup_scripts.shown_files(tool, origin, model, secret)
            url = f"{origin}/setup/{tool}?model={quote(model, safe='')}"
            editor["command"] = f"export {setup_scripts.KEY_ENV}='{secret}'\ncurl -fsSL '{url}' | sh"
        return await self._page(request, editor=editor)

    # -- the setup script (open: curl fetches it without a session) ---------------------------------------

    async def setup_script(self, request: web.Request) -> web.StreamResponse:
        tool = request.match_info["tool"]
        headers = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
        if tool not in setup_scripts.SCRIPTED:
            return web.Response(
                status=404,
                text=f"There is no setup script for that tool here; there are: {', '.join(setup_scripts.SCRIPTED)}.\n",
                headers=headers,
            )
        models = self.models()
        model = request.query.get("model") or (models[0] if models else "")
        if model not in models:
            return web.Response(
                status=404,
                text="This gateway serves no model by that name; the account page lists those it serves.\n",
                headers=headers,
            )
        try:
            body = setup_scripts.script(tool, self._origin(request), model)
        except setup_scripts.Unsafe:
            return web.Response(
                status=400,
                text="The address this request came through (Host, X-Forwarded-Host) cannot go into a script.\n",
                headers=headers,
            )
        return web.Response(text=body, content_type="text/plain", charset="utf-8", headers=headers)
