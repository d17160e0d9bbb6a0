"""People (/admin/users): sign-ups waiting for approval, the tenancy tree with its members and keys,
and every account.

Each action is a plain form posted with the session's CSRF token (the guard checks it) and
answered by a redirect back to the page, which then says what was done; when the store
refuses, the page is shown again with the store's own sentence (only empty things can be
removed, a project that ever had a key never is). Nothing a person typed is trusted: the
templates escape every name and email, and the store checks every id a form sends.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from aiohttp import web
from multidict import MultiDictProxy

from llmgw.server.pages import PageError
from llmgw.server.pages.admin_format import FMT
from llmgw.server.pages.session import current, local_target, redirect
from llmgw.server.pages.site import Site
from llmgw.store import KeyRecord, Org, Project, StoreError, Team, Tree, User

PAGE = "/admin/users"
KIND_WORDS = {"org": "organization", "team": "team", "project": "project"}
MAX_ACCOUNTS = 200  # accounts listed at once; the search narrows them
MAX_SAID = 1000  # sessions whose last action's sentence waits to be shown
MAX_FIELD = 400

Form = MultiDictProxy[str | Any]


class Refused(PageError):
    """A page-level refusal, shown like the store's."""


@dataclass
class Member:
    user: User
    role: str  # member | manager
    scope: str
    scope_id: str


@dataclass
class ProjectView:
    project: Project
    members: list[Member]
    keys: list[KeyRecord]


@dataclass
class TeamView:
    team: Team
    members: list[Member]
    projects: list[ProjectView] = field(default_factory=list)


@dataclass
class OrgView:
    org: Org
    members: list[Member]
    teams: list[TeamView] = field(default_factory=list)


@dataclass
class Account:
    user: User
    places: list[Member]
    keys: list[KeyRecord]  # personal keys (no project), and those it made in projects


@dataclass(frozen=True)
class Place:
    """Where a person can be added: value "kind:id", shown as its path."""

    value: str
    label: str


def _session_key(token: str) -> str:
    """Whose sentence it is, without keeping the session's token itself (the store keeps only its hash too)."""
    return hashlib.sha256(token.encode()).hexdigest()


def _text(form: Form, name: str) -> str:
    return str(form.get(name, "")).strip()[:MAX_FIELD]


def _where(form: Form) -> tuple[str, str]:
    kind, _, ref = _text(form, "where").partition(":")
    if kind not in KIND_WORDS or not ref:
        raise Refused("Choose an organization, team or project.")
    return kind, ref


def _kind(form: Form, verb: str) -> str:
    """The form's kind of node (org, team or project), refused in words with what was asked ("Add")."""
    kind = _text(form, "kind")
    if kind not in KIND_WORDS:
        raise Refused(f"{verb} an organization, a team or a project.")
    return kind


def _back(form: Form) -> str:
    """Back to the People page as it was (its search, the open project); never elsewhere."""
    back = local_target(_text(form, "back"), PAGE)
    return back if urlsplit(back).path == PAGE else PAGE


def build_tree(tree: Tree, keys: list[KeyRecord]) -> list[OrgView]:
    by_scope: dict[tuple[str, str], list[Member]] = {}
    for m in tree.memberships:
        user = tree.users.get(m.user_id)
        if user is not None:
            by_scope.setdefault((m.scope, m.scope_id), []).append(Member(user, m.role, m.scope, m.scope_id))
    for members in by_scope.values():
        members.sort(key=lambda m: (m.role != "manager", m.user.email))
    keys_by_project: dict[str, list[KeyRecord]] = {}
    for k in keys:
        if k.project_id is not None:
            keys_by_project.setdefault(k.project_id, []).append(k)
    orgs = {o.id: OrgView(o, by_scope.get(("org", o.id), [])) for o in tree.orgs.values()}
    teams: dict[str, TeamView] = {}
    for t in tree.teams.values():
        teams[t.id] = TeamView(t, by_scope.get(("team", t.id), []))
        orgs[t.org_id].teams.append(teams[t.id])
    for p in tree.projects.values():
        teams[p.team_id].projects.append(
            ProjectView(p, by_scope.get(("project", p.id), []), keys_by_project.get(p.id, []))
        )
    return list(orgs.values())


def accounts(tree: Tree, keys: list[KeyRecord], q: str) -> tuple[list[Account], int]:
    """Every account whose email (or name) holds q, by email; and how many matched in all."""
    needle = q.lower()
    found = [
        u
        for u in tree.users.values()
        if not needle or needle in u.email.lower() or (u.name is not None and needle in u.name.lower())
    ]
    found.sort(key=lambda u: u.email)
    places: dict[str, list[Member]] = {}
    for m in tree.memberships:
        if m.user_id in tree.users:
            places.setdefault(m.user_id, []).append(Member(tree.users[m.user_id], m.role, m.scope, m.scope_id))
    owned: dict[str, list[KeyRecord]] = {}
    for k in keys:
        if k.user_id is not None:
            owned.setdefault(k.user_id, []).append(k)
    return [Account(u, places.get(u.id, []), owned.get(u.id, [])) for u in found[:MAX_ACCOUNTS]], len(found)


def places(tree: Tree) -> list[Place]:
    out = [Place(f"org:{o.id}", f"{o.path} (organization)") for o in tree.orgs.values()]
    out += [Place(f"team:{t.id}", f"{t.path} (team)") for t in tree.teams.values()]
    out += [Place(f"project:{p.id}", f"{p.path} (project)") for p in tree.projects.values()]
    return sorted(out, key=lambda p: p.label.lower())


class PeoplePage:
    def __init__(self, site: Site) -> None:
        self.site = site
        self.store = site.store
        # The sentence saying what the last action did, shown once by the page it redirects to.
        self._said: OrderedDict[str, str] = OrderedDict()

    def add_routes(self) -> None:
        self.site.menu.add("People", PAGE, "admin")
        self.site.route("GET", PAGE, "admin", self.page)
        for path, action in (
            ("/admin/users/approve", self._approve),
            ("/admin/users/reject", self._reject),
            ("/admin/users/state", self._state),
            ("/admin/users/remove", self._remove_user),
            ("/admin/users/promote", self._promote),
            ("/admin/users/join", self._join),
            ("/admin/users/leave", self._leave),
            ("/admin/users/revoke-key", self._revoke_key),
            ("/admin/tree/add", self._add),
            ("/admin/tree/rename", self._rename),
            ("/admin/tree/remove", self._remove),
        ):
            self.site.route("POST", path, "admin", self._action(action))

    # -- the page ---------------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.StreamResponse:
        visitor = current(request)
        said = self._said.pop(_session_key(visitor.token), "") if visitor is not None else ""
        return await self._render(request, request.query.get("q", ""), request.query.get("open", ""), said=said)

    async def _render(
        self, request: web.Request, q: str, open_: str, *, said: str = "", problem: str = "", status: int = 200
    ) -> web.StreamResponse:
        q = q.strip()[:MAX_FIELD]
        tree = await self.store.tree(people=True)
        keys = await self.store.list_keys(include_revoked=False)
        found, matched = accounts(tree, keys, q)
        back = PAGE + ("?" + urlencode({"q": q}) if q else "")

        def back_for(kind: str, node_id: str) -> str:
            """Back to this page with the project acted on open, scrolled to what was acted on."""
            query = {"q": q} if q else {}
            if kind == "project":
                query["open"] = node_id
            return PAGE + ("?" + urlencode(query) if query else "") + f"#{kind}-{node_id}"

        def email_of(user_id: str) -> str:
            user = tree.users.get(user_id)
            return user.email if user is not None else f"{user_id} (removed)"

        return self.site.render.page(
            request,
            "admin_people.html",
            status,
            fmt=FMT,
            said=said,
            problem=problem,
            pending=sorted((u for u in tree.users.values() if u.state == "pending"), key=lambda u: u.created_at),
            projects=sorted(tree.projects.values(), key=lambda p: p.path.lower()),
            orgs=build_tree(tree, keys),
            accounts=found,
            matched=matched,
            max_accounts=MAX_ACCOUNTS,
            q=q,
            open=open_,
            back=back,
            places=places(tree),
            path_of=tree.path_of,
            back_for=back_for,
            email_of=email_of,
        )

    # -- actions ----------------------------------------------------------------------------

    def _action(
        self, act: Callable[[web.Request, Form], Awaitable[str]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            form = await request.post()
            back = _back(form)
            try:
                said = await act(request, form)
            except (StoreError, Refused) as exc:
                query = parse_qs(urlsplit(back).query)
                return await self._render(
                    request,
                    query.get("q", [""])[0],
                    query.get("open", [""])[0],
                    problem=str(exc),
                    status=409 if isinstance(exc, StoreError) else 400,
                )
            visitor = current(request)
            if visitor is not None:
                key = _session_key(visitor.token)
                self._said[key] = said
                self._said.move_to_end(key)
                while len(self._said) > MAX_SAID:
                    self._said.popitem(last=False)
            return redirect(request, back)

        handle.__name__ = act.__name__.lstrip("_")
        return handle

    @staticmethod
    def _not_me(request: web.Request, user: str, what: str) -> None:
        visitor = current(request)
        if visitor is not None and user == visitor.user.id:
            raise Refused(f"You cannot {what} your own account here; another administrator can.")

    async def _approve(self, request: web.Request, form: Form) -> str:
        project = _text(form, "project") or None
        person = await self.store.approve(_text(form, "user"), project)
        if project is None:
            return f"Approved {person.email}, on their own (in no project yet)."
        return f"Approved {person.email} into {(await self.store.find('project', project)).path}."

    async def _reject(self, request: web.Request, form: Form) -> str:
        person = await self.store.reject(_text(form, "user"))
        return f"Rejected the sign-up of {person.email}; the address may sign up again."

    async def _state(self, request: web.Request, form: Form) -> str:
        state = _text(form, "state")
        user = _text(form, "user")
        if state == "suspended":
            self._not_me(request, user, "suspend")
        person = await self.store.set_user_state(user, state)
        if state == "suspended":
            return f"Suspended {person.email}: signed out everywhere, their keys refused until reinstated."
        return f"Reinstated {person.email}."

    async def _remove_user(self, request: web.Request, form: Form) -> str:
        user = _text(form, "user")
        self._not_me(request, user, "remove")
        person, revoked = await self.store.delete_user(user)
        return f"Removed {person.email}; {len(revoked)} key(s) revoked."

    async def _promote(self, request: web.Request, form: Form) -> str:
        person = await self.store.promote(_text(form, "user"))
        return f"{person.email} is an administrator now."

    async def _join(self, request: web.Request, form: Form) -> str:
        kind, ref = _where(form)
        role = _text(form, "role") or "member"
        person, _, path = await self.store.join(_text(form, "user"), kind, ref, role)
        if role == "manager":
            return f"{person.email} manages {path} now."
        return f"{person.email} is a member of {path}."

    async def _leave(self, request: web.Request, form: Form) -> str:
        kind, ref = _where(form)
        path, revoked = await self.store.leave(_text(form, "user"), kind, ref)
        gone = f"; {len(revoked)} of their key(s) there revoked" if revoked else ""
        return f"Took them out of {path}{gone}."

    async def _revoke_key(self, request: web.Request, form: Form) -> str:
        key = await self.store.revoke_key(_text(form, "key"))
        return f"Revoked the key {key.name} ({key.prefix}…)."

    async def _add(self, request: web.Request, form: Form) -> str:
        kind = _kind(form, "Add")
        node = await self.store.add(kind, _text(form, "name"), _text(form, "parent") or None)
        return f"Added the {KIND_WORDS[kind]} {node.path}."

    async def _rename(self, request: web.Request, form: Form) -> str:
        kind = _kind(form, "Rename")
        node = await self.store.rename(kind, _text(form, "id"), _text(form, "name"))
        return f"Renamed the {KIND_WORDS[kind]}: it is {node.path} now."

    async def _remove(self, request: web.Request, form: Form) -> str:
        kind = _kind(form, "Remove")
        node = await self.store.remove(kind, _text(form, "id"))
        return f"Removed the {KIND_WORDS[kind]} {node.path}."
