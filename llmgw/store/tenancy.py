"""The tenancy tree (organizations > teams > projects), the people in it, their keys,
claim links and the limits set on every level. Mixed into Store: each method is one
transaction that checks everything before it changes anything, and bumps the keys
generation so a running gateway rebuilds its principals."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, Literal, cast, overload

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from cryptography.fernet import Fernet, InvalidToken
from sqlalchemy import Table, delete, func, or_, select, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .errors import Ambiguous, NotFound, NotMember, StoreError
from .keyrows import KEY_COLS, PREFIX_LEN, check_key_text, hash_secret, key_from_row, new_secret
from .records import CostRow, IssuedKey, KeyRecord, LimitRecord, Membership, Org, Project, Team, Tree, User, utcnow
from .reports import record_limit_change
from .schema import (
    BUMP_GENERATION,
    api_keys,
    browser_sessions,
    key_claims,
    limits,
    memberships,
    memory_notes,
    organizations,
    project_retention,
    projects,
    stored_responses,
    teams,
    thread_messages,
    threads,
    usage,
    users,
)

KINDS = ("org", "team", "project")
KIND_WORDS = {"org": "organization", "team": "team", "project": "project"}
ID_PREFIX = {"org": "org-", "team": "team-", "project": "proj-", "user": "usr-"}
LIMIT_SCOPES = ("org", "team", "project", "user", "key")
MEMBER_SCOPES = {"org": "org-member", "team": "team-member", "project": "project-member"}
BANDS = ("low", "normal", "high")
PERIODS = ("day", "month")
ROLES = ("member", "manager")
USER_STATES = ("active", "suspended", "pending")
CLAIM_TTL = timedelta(days=7)
MIN_PASSWORD_LEN = 8
MAX_NAME_LEN = 200
# Names that look like ids would make "id, path or name" ambiguous.
_ID_LIKE = re.compile(r"(org|team|proj|usr|key)-[0-9a-z]{6,}")
_EMAIL = re.compile(r"[^@\s]+@[^@\s]+")

UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET", "__bool__": lambda self: False})()

_hasher = PasswordHasher()
# Sign-up refusals say the same whether the existing account is active or waiting for
# approval: the sign-up page must not tell strangers more about who has an account.
SIGN_UP_TAKEN = "This email cannot sign up: it has an account, or a sign-up waiting for approval."


@functools.cache
def _dummy_hash() -> str:
    return _hasher.hash(secrets.token_urlsafe(16))


async def _password_matches(pw_hash: str | None, password: object) -> bool:
    """Whether the password matches the argon2 hash. Without a hash, a hash is checked all
    the same, so a wrong email costs as long as a wrong password and timing tells no one
    which emails have accounts. In a thread: argon2 takes tens of milliseconds of CPU,
    which must not stall the event loop serving requests."""
    if not isinstance(password, str):
        return False
    try:
        matched = await asyncio.to_thread(lambda: _hasher.verify(pw_hash or _dummy_hash(), password))
    except (VerificationError, InvalidHashError):
        return False
    return matched and bool(pw_hash)


def _check_password(password: object) -> str:
    if not isinstance(password, str) or len(password) < MIN_PASSWORD_LEN:
        raise StoreError(f"A password needs at least {MIN_PASSWORD_LEN} characters.")
    return password


def _new_id(kind: str) -> str:
    return ID_PREFIX[kind] + secrets.token_hex(5)


def _check_name(kind: str, name: object) -> str:
    word = KIND_WORDS.get(kind, kind)
    a = "An" if word[:1] in "aeiou" else "A"
    if not isinstance(name, str) or not name.strip():
        raise StoreError(f"Give the {word} a name.")
    name = name.strip()
    if "/" in name:
        raise StoreError(f'{a} {word} name cannot contain "/" (it separates the parts of a path): {name!r}.')
    if len(name) > MAX_NAME_LEN:
        raise StoreError(f"{a} {word} name is at most {MAX_NAME_LEN} characters; {name[:20]!r}… has {len(name)}.")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise StoreError(f"{a} {word} name cannot contain control characters: {name!r}.")
    if _ID_LIKE.fullmatch(name):
        raise StoreError(f"{name!r} looks like an id; give the {word} a name that does not.")
    return name


def _seal_key(token: str) -> Fernet:
    # The token's hash finds the row; a different digest of it seals the secret, so the
    # stored row alone cannot open it.
    return Fernet(base64.urlsafe_b64encode(hashlib.sha256(b"llmgw-claim-seal:" + token.encode()).digest()))


def _models_text(models: Iterable[str] | None) -> str | None:
    return None if models is None else json.dumps(sorted(set(models)))


def _limit(row: Row[Any]) -> LimitRecord:
    m = row._mapping
    return LimitRecord(
        scope=m["scope"],
        scope_id=m["scope_id"],
        rpm=m["rpm"],
        tpm=m["tpm"],
        budget_micros=m["budget_micros"],
        period=m["period"],
        models=None if m["models"] is None else tuple(json.loads(m["models"])),
        band=m["band"],
    )


def _user(row: Row[Any]) -> User:
    m = row._mapping
    return User(
        id=m["id"],
        email=m["email"],
        name=m["name"],
        state=m["state"],
        admin=bool(m["admin"]),
        created_at=m["created_at"],
    )


async def _load_tree(conn: AsyncConnection, people: bool = False, with_limits: bool = False) -> Tree:
    orgs = {
        r.id: Org(r.id, r.name)
        for r in await conn.execute(select(organizations.c.id, organizations.c.name).order_by(organizations.c.name))
    }
    tms: dict[str, Team] = {}
    for r in await conn.execute(select(teams.c.id, teams.c.name, teams.c.org_id).order_by(teams.c.name)):
        tms[r.id] = Team(r.id, r.name, r.org_id, f"{orgs[r.org_id].name}/{r.name}")
    projs: dict[str, Project] = {}
    for r in await conn.execute(select(projects.c.id, projects.c.name, projects.c.team_id).order_by(projects.c.name)):
        t = tms[r.team_id]
        projs[r.id] = Project(r.id, r.name, r.team_id, t.org_id, f"{t.path}/{r.name}")
    ms: tuple[Membership, ...] = ()
    us: dict[str, User] = {}
    if people:
        ms = tuple(
            Membership(r.user_id, r.scope, r.scope_id, r.role)
            for r in await conn.execute(
                select(memberships).order_by(memberships.c.user_id, memberships.c.scope, memberships.c.scope_id)
            )
        )
        us = {u.id: u for u in map(_user, await conn.execute(select(users).order_by(users.c.email)))}
    lims: dict[tuple[str, str], LimitRecord] = {}
    if with_limits:
        lims = {(r.scope, r.scope_id): r for r in map(_limit, await conn.execute(select(limits)))}
    return Tree(orgs, tms, projs, ms, us, lims)


def _tables(tree: Tree) -> dict[str, Mapping[str, Org | Team | Project]]:
    return {"org": tree.orgs, "team": tree.teams, "project": tree.projects}


@overload
def _find(tree: Tree, kind: Literal["org"], ref: object) -> Org: ...
@overload
def _find(tree: Tree, kind: Literal["team"], ref: object) -> Team: ...
@overload
def _find(tree: Tree, kind: Literal["project"], ref: object) -> Project: ...
@overload
def _find(tree: Tree, kind: str, ref: object) -> Org | Team | Project: ...


def _find(tree: Tree, kind: str, ref: object) -> Org | Team | Project:
    """A node by id, path or unique name; refuses what names nothing or more than one."""
    word = KIND_WORDS[kind]
    table = _tables(tree)[kind]
    if not isinstance(ref, str) or not ref.strip():
        raise NotFound(f"Give the {word}'s id, path or name.")
    ref = ref.strip().strip("/")
    if ref in table:
        return table[ref]
    if "/" in ref:
        found = [n for n in table.values() if n.path == ref]
        if not found:
            depth = {"org": 1, "team": 2, "project": 3}[kind]
            shape = "/".join(["ORG", "TEAM", "PROJECT"][:depth])
            extra = "" if ref.count("/") + 1 == depth else f" (a {word} path looks like {shape})"
            raise NotFound(f'No {word} at "{ref}"{extra}; `llmgw org tree` shows what exists.')
        return found[0]
    found = sorted((n for n in table.values() if n.name == ref), key=lambda n: n.path)
    if not found:
        raise NotFound(f'No {word} is named "{ref}"; `llmgw org tree` shows what exists.')
    if len(found) > 1:
        paths = [n.path for n in found]
        raise Ambiguous(f'"{ref}" names {len(found)} {word}s: {", ".join(paths)}; give the path.', paths)
    return found[0]


async def _find_user(conn: AsyncConnection, ref: object) -> User:
    if not isinstance(ref, str) or not ref.strip():
        raise NotFound("Give the person's id (usr-…) or email.")
    ref = ref.strip()
    row = (await conn.execute(select(users).where(or_(users.c.id == ref, users.c.email == ref.lower())))).first()
    if row is None:
        raise NotFound(f'No person has the id or email "{ref}"; `llmgw users list` shows who exists.')
    return _user(row)


def _non_negative(flag: str, value: object, integer: bool = True) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "a whole number" if integer else "a number"
        raise StoreError(f"{flag} must be {kind} of at least 0, not {value!r}.")
    if value < 0:
        raise StoreError(f"{flag} cannot be negative ({value}); give 0 or more.")
    return value


class TenancyMixin:
    """Store methods for the tree, people, tenant keys, claims and limits."""

    _engine: AsyncEngine
    _writer: AsyncEngine

    # -- the tree ------------------------------------------------------------------

    async def tree(self, people: bool = False, with_limits: bool = False) -> Tree:
        async with self._engine.connect() as conn:
            return await _load_tree(conn, people=people, with_limits=with_limits)

    async def find(self, kind: str, ref: str) -> Org | Team | Project:
        """An organization, team or project by id, path or unique name."""
        if kind not in KINDS:
            raise StoreError(f'The kind is org, team or project, not "{kind}".')
        return _find(await self.tree(), kind, ref)

    @overload
    async def add(self, kind: Literal["org"], name: str, parent: str | None = None) -> Org: ...
    @overload
    async def add(self, kind: Literal["team"], name: str, parent: str | None = None) -> Team: ...
    @overload
    async def add(self, kind: Literal["project"], name: str, parent: str | None = None) -> Project: ...
    @overload
    async def add(self, kind: str, name: str, parent: str | None = None) -> Org | Team | Project: ...

    async def add(self, kind: str, name: str, parent: str | None = None) -> Org | Team | Project:
        """A new organization, a team in an organization, or a project in a team; its name
        must be unique among its siblings."""
        if kind not in KINDS:
            raise StoreError(f'The kind is org, team or project, not "{kind}".')
        name = _check_name(kind, name)
        async with self._writer.begin() as conn:
            tree = await _load_tree(conn)
            up: Org | Team | None
            node: Org | Team | Project
            values: dict[str, str]
            if kind == "org":
                up, node, values = None, Org(_new_id("org"), name), {}
            elif kind == "team":
                up = _find(tree, "org", parent)
                node, values = Team(_new_id("team"), name, up.id, f"{up.path}/{name}"), {"org_id": up.id}
            else:
                up = _find(tree, "team", parent)
                node = Project(_new_id("project"), name, up.id, up.org_id, f"{up.path}/{name}")
                values = {"team_id": up.id}
            table, siblings = self._siblings(tree, kind, node)
            if any(s.name == name for s in siblings):
                where = f"{up.path} has" if up is not None else "There is"
                raise StoreError(f'{where} a {KIND_WORDS[kind]} named "{name}" already.')
            await conn.execute(table.insert().values(id=node.id, name=name, created_at=utcnow(), **values))
            await conn.execute(BUMP_GENERATION)
        return node

    async def add_org(self, name: str) -> Org:
        return await self.add("org", name)

    async def add_team(self, name: str, org: str) -> Team:
        return await self.add("team", name, org)

    async def add_project(self, name: str, team: str) -> Project:
        return await self.add("project", name, team)

    async def rename(self, kind: str, ref: str, new_name: str) -> Org | Team | Project:
        """Rename in place; the id, and so keys, limits and usage, stay with it."""
        if kind not in KINDS:
            raise StoreError(f'The kind is org, team or project, not "{kind}".')
        new_name = _check_name(kind, new_name)
        async with self._writer.begin() as conn:
            tree = await _load_tree(conn)
            node = _find(tree, kind, ref)
            table, siblings = self._siblings(tree, kind, node)
            if any(s.name == new_name and s.id != node.id for s in siblings):
                raise StoreError(f'There is a {KIND_WORDS[kind]} named "{new_name}" there already.')
            await conn.execute(update(table).where(table.c.id == node.id).values(name=new_name))
            await conn.execute(BUMP_GENERATION)
            return _find(await _load_tree(conn), kind, node.id)

    @staticmethod
    def _siblings(tree: Tree, kind: str, node: Org | Team | Project) -> tuple[Table, Sequence[Org | Team | Project]]:
        # node is of the kind given.
        if kind == "org":
            return organizations, list(tree.orgs.values())
        if kind == "team":
            return teams, [t for t in tree.teams.values() if t.org_id == cast(Team, node).org_id]
        return projects, [p for p in tree.projects.values() if p.team_id == cast(Project, node).team_id]

    async def move(self, kind: str, ref: str, to: str) -> Team | Project:
        """A team to another organization, a project to another team."""
        if kind not in ("team", "project"):
            raise StoreError(f'Only a team (to an organization) or a project (to a team) can move; not "{kind}".')
        parent_kind = "org" if kind == "team" else "team"
        async with self._writer.begin() as conn:
            tree = await _load_tree(conn)
            node = _find(tree, kind, ref)
            parent = _find(tree, parent_kind, to)
            table = teams if kind == "team" else projects
            column = "org_id" if kind == "team" else "team_id"
            siblings = [
                n
                for n in (tree.teams if kind == "team" else tree.projects).values()
                if getattr(n, column) == parent.id and n.id != node.id
            ]
            if any(s.name == node.name for s in siblings):
                raise StoreError(f'{parent.path} has a {KIND_WORDS[kind]} named "{node.name}" already.')
            await conn.execute(update(table).where(table.c.id == node.id).values({column: parent.id}))
            await conn.execute(BUMP_GENERATION)
            # kind is team or project, checked above.
            return cast(Team | Project, _find(await _load_tree(conn), kind, node.id))

    async def remove(self, kind: str, ref: str) -> Org | Team | Project:
        """Remove an empty organization, team or project. A project that ever had a key is
        never removed: its usage history refers to it."""
        if kind not in KINDS:
            raise StoreError(f'The kind is org, team or project, not "{kind}".')
        async with self._writer.begin() as conn:
            tree = await _load_tree(conn, people=True)
            node = _find(tree, kind, ref)
            if kind == "org":
                inside = [t.path for t in tree.teams.values() if t.org_id == node.id]
            elif kind == "team":
                inside = [p.path for p in tree.projects.values() if p.team_id == node.id]
            else:
                inside = []
                had_keys = await conn.scalar(
                    select(func.count()).select_from(api_keys).where(api_keys.c.project_id == node.id)
                )
                used = await conn.scalar(select(func.count()).select_from(usage).where(usage.c.project_id == node.id))
                if had_keys or used:
                    raise StoreError(
                        f"{node.path} has had keys; a project that ever had a key is "
                        "never removed (its usage history refers to it)."
                    )
            if inside:
                raise StoreError(f"{node.path} is not empty ({', '.join(inside)}); remove or move what is in it first.")
            members = [m for m in tree.memberships if m.scope == kind and m.scope_id == node.id]
            if members:
                who = ", ".join(tree.users[m.user_id].email for m in members)
                raise StoreError(f"{node.path} has members ({who}); `llmgw users leave` them first.")
            table = {"org": organizations, "team": teams, "project": projects}[kind]
            if kind == "project":
                # Its conversations, responses and notes go with it: SQLite does not enforce the
                # foreign keys' ON DELETE CASCADE.
                ids = select(threads.c.id).where(threads.c.project_id == node.id)
                await conn.execute(delete(thread_messages).where(thread_messages.c.thread.in_(ids)))
                for t in (threads, stored_responses, memory_notes, project_retention):
                    await conn.execute(delete(t).where(t.c.project_id == node.id))
            await conn.execute(
                delete(limits).where(limits.c.scope.in_([kind, MEMBER_SCOPES[kind]]), limits.c.scope_id == node.id)
            )
            await conn.execute(delete(table).where(table.c.id == node.id))
            await conn.execute(BUMP_GENERATION)
        return node

    # -- people --------------------------------------------------------------------

    async def create_user(
        self,
        email: str,
        password: str | None = None,
        name: str | None = None,
        admin: bool = False,
        pending: bool = False,
    ) -> User:
        """An account, active unless pending (a sign-up: it signs in only once approved)."""
        if pending and admin:
            raise StoreError("A sign-up waiting for approval cannot be an administrator; promote it once approved.")
        if pending and password is None:
            raise StoreError("A sign-up needs a password.")
        if not isinstance(email, str) or not _EMAIL.fullmatch(email.strip()) or len(email) > 320:
            raise StoreError(f"{email!r} is not an email address.")
        email = email.strip().lower()
        if name is not None:
            name = name.strip() or None
            if name and (len(name) > MAX_NAME_LEN or any(ord(c) < 32 for c in name)):
                raise StoreError(f"A person's name is one line of at most {MAX_NAME_LEN} characters.")
        pw_hash = None
        if password is not None:
            pw_hash = await asyncio.to_thread(_hasher.hash, _check_password(password))
        user = User(_new_id("user"), email, name, "pending" if pending else "active", bool(admin), utcnow())
        async with self._writer.begin() as conn:
            taken = (await conn.execute(select(users.c.id).where(users.c.email == email))).first()
            if taken:
                raise StoreError(SIGN_UP_TAKEN if pending else f"{email} has an account already ({taken.id}).")
            await conn.execute(
                users.insert().values(
                    id=user.id,
                    email=email,
                    name=name,
                    password_hash=pw_hash,
                    state=user.state,
                    admin=user.admin,
                    created_at=user.created_at,
                )
            )
            # A sign-up owns no keys and is in no principal: strangers signing up must not
            # make every gateway reload its keys.
            if not pending:
                await conn.execute(BUMP_GENERATION)
        return user

    async def sign_up(self, email: str, password: str, name: str | None = None) -> User:
        """A pending account, waiting for an administrator's approval. An email that has an
        account (in any state) is refused with SIGN_UP_TAKEN, which does not say which."""
        return await self.create_user(email, password, name=name, pending=True)

    async def find_user(self, ref: str) -> User:
        async with self._engine.connect() as conn:
            return await _find_user(conn, ref)

    async def verify_password(self, email: str, password: str) -> User | None:
        """The person, when the email and password match an active account (None for a
        pending or suspended one, as for a wrong password)."""
        row = None
        if isinstance(email, str):
            async with self._engine.connect() as conn:
                row = (await conn.execute(select(users).where(users.c.email == email.strip().lower()))).first()
        if not await _password_matches(row.password_hash if row is not None else None, password):
            return None
        assert row is not None  # no row has no hash, which matches nothing
        user = _user(row)
        return user if user.state == "active" else None

    async def check_password(self, user_id: str, password: str) -> bool:
        """Whether the password is the person's (whatever their state): asked again before
        a password change."""
        async with self._engine.connect() as conn:
            pw_hash = await conn.scalar(select(users.c.password_hash).where(users.c.id == user_id))
        return await _password_matches(pw_hash, password)

    async def set_password(self, user_id: str, new_password: str) -> None:
        """Replace a person's password. Their sessions stay: end_sessions(user_id,
        except_token=...) signs the other browsers out."""
        pw_hash = await asyncio.to_thread(_hasher.hash, _check_password(new_password))
        async with self._writer.begin() as conn:
            person = await _find_user(conn, user_id)
            await conn.execute(update(users).where(users.c.id == person.id).values(password_hash=pw_hash))

    async def list_users(self, state: str | None = None) -> list[tuple[User, list[Membership]]]:
        """People by email with their memberships; with state, only those in it ("pending":
        the sign-ups waiting for approval)."""
        if state is not None and state not in USER_STATES:
            raise StoreError(f'A person is {", ".join(USER_STATES)}, not "{state}".')
        tree = await self.tree(people=True)
        return [
            (u, [m for m in tree.memberships if m.user_id == u.id])
            for u in tree.users.values()
            if state is None or u.state == state
        ]

    async def join(self, user: str, kind: str, ref: str, role: str = "member") -> tuple[User, Membership, str]:
        """Make a person a member (or an organization's manager); returns the path joined."""
        if kind not in KINDS:
            raise StoreError(f'A person joins an org, a team or a project, not "{kind}".')
        if role not in ROLES:
            raise StoreError(f'The role is member or manager, not "{role}".')
        if role == "manager" and kind != "org":
            raise StoreError("manager is a role in an organization; join a team or project as a member.")
        async with self._writer.begin() as conn:
            person = await _find_user(conn, user)
            node = _find(await _load_tree(conn), kind, ref)
            await conn.execute(
                delete(memberships).where(
                    memberships.c.user_id == person.id, memberships.c.scope == kind, memberships.c.scope_id == node.id
                )
            )
            await conn.execute(
                memberships.insert().values(
                    user_id=person.id, scope=kind, scope_id=node.id, role=role, created_at=utcnow()
                )
            )
            await conn.execute(BUMP_GENERATION)
        return person, Membership(person.id, kind, node.id, role), node.path

    async def leave(self, user: str, kind: str, ref: str) -> tuple[str, list[KeyRecord]]:
        """End a membership; keys made in projects it no longer reaches are revoked.
        Returns the path left and the keys revoked."""
        if kind not in KINDS:
            raise StoreError(f'A person leaves an org, a team or a project, not "{kind}".')
        async with self._writer.begin() as conn:
            person = await _find_user(conn, user)
            node = _find(await _load_tree(conn), kind, ref)
            done = await conn.execute(
                delete(memberships).where(
                    memberships.c.user_id == person.id, memberships.c.scope == kind, memberships.c.scope_id == node.id
                )
            )
            if done.rowcount != 1:
                raise NotMember(f"{person.email} is not a member of {node.path}.")
            tree = await _load_tree(conn, people=True)
            revoked = await self._revoke_owned(
                conn,
                person.id,
                lambda k: (
                    k.project_id is not None
                    and (k.project_id not in tree.projects or not tree.reaches(person.id, tree.projects[k.project_id]))
                ),
            )
            await conn.execute(BUMP_GENERATION)
        return node.path, revoked

    async def _revoke_owned(
        self, conn: AsyncConnection, user_id: str, which: Callable[[KeyRecord], bool]
    ) -> list[KeyRecord]:
        rows = await conn.execute(
            select(*KEY_COLS).where(api_keys.c.user_id == user_id, api_keys.c.revoked_at.is_(None))
        )
        now = utcnow()
        gone = [k for k in map(key_from_row, rows) if which(k)]
        if gone:
            await conn.execute(update(api_keys).where(api_keys.c.id.in_([k.id for k in gone])).values(revoked_at=now))
        return [replace(k, revoked_at=now) for k in gone]

    async def set_user_state(self, user: str, state: str) -> User:
        """Suspend (signed out everywhere; their keys stop working, none is revoked) or
        reinstate a person. A sign-up is approved or rejected instead."""
        if state not in ("active", "suspended"):
            raise StoreError(
                f'A person is made active or suspended, not "{state}"; an account is pending only from signing up.'
            )
        async with self._writer.begin() as conn:
            person = await _find_user(conn, user)
            if person.state == "pending":
                raise StoreError(
                    f"{person.email} is a sign-up waiting for approval; approve it (`llmgw users approve`) or reject it."
                )
            await conn.execute(update(users).where(users.c.id == person.id).values(state=state))
            if state == "suspended":
                await conn.execute(delete(browser_sessions).where(browser_sessions.c.user_id == person.id))
            await conn.execute(BUMP_GENERATION)
        return replace(person, state=state)

    async def approve(self, user: str, project: str | None = None) -> User:
        """Turn a pending sign-up into an active account that can sign in; with project,
        make them a member of it in the same transaction."""
        async with self._writer.begin() as conn:
            person = await _find_user(conn, user)
            if person.state != "pending":
                raise StoreError(f"{person.email} is {person.state}, not a sign-up waiting for approval.")
            if project is not None:
                node = _find(await _load_tree(conn), "project", project)
                await conn.execute(
                    delete(memberships).where(
                        memberships.c.user_id == person.id,
                        memberships.c.scope == "project",
                        memberships.c.scope_id == node.id,
                    )
                )
                await conn.execute(
                    memberships.insert().values(
                        user_id=person.id, scope="project", scope_id=node.id, role="member", created_at=utcnow()
                    )
                )
            await conn.execute(update(users).where(users.c.id == person.id).values(state="active"))
            await conn.execute(BUMP_GENERATION)
        return replace(person, state="active")

    async def reject(self, user: str) -> User:
        """Remove a sign-up waiting for approval (it may sign up again). Accounts that were
        ever approved are suspended or deleted instead."""
        async with self._writer.begin() as conn:
            person = await _find_user(conn, user)
            if person.state != "pending":
                raise StoreError(
                    f"{person.email} is {person.state}: only a sign-up waiting for approval is rejected; "
                    "suspend or delete an account."
                )
            # An administrator may have joined or limited the sign-up already; a pending
            # account never had keys (issue_key refuses it) or sessions.
            await conn.execute(delete(memberships).where(memberships.c.user_id == person.id))
            await conn.execute(delete(limits).where(limits.c.scope == "user", limits.c.scope_id == person.id))
            await conn.execute(delete(users).where(users.c.id == person.id))
            await conn.execute(BUMP_GENERATION)
        return person

    async def promote(self, user: str) -> User:
        """Give a person the administrator pages."""
        async with self._writer.begin() as conn:
            person = await _find_user(conn, user)
            await conn.execute(update(users).where(users.c.id == person.id).values(admin=True))
            await conn.execute(BUMP_GENERATION)
        return replace(person, admin=True)

    async def delete_user(self, user: str) -> tuple[User, list[KeyRecord]]:
        """Remove a person: signed out everywhere, their keys revoked, memberships and own
        limits gone. Usage rows keep their id."""
        async with self._writer.begin() as conn:
            person = await _find_user(conn, user)
            revoked = await self._revoke_owned(conn, person.id, lambda k: True)
            await conn.execute(delete(browser_sessions).where(browser_sessions.c.user_id == person.id))
            await conn.execute(delete(memberships).where(memberships.c.user_id == person.id))
            await conn.execute(delete(limits).where(limits.c.scope == "user", limits.c.scope_id == person.id))
            await conn.execute(delete(users).where(users.c.id == person.id))
            await conn.execute(BUMP_GENERATION)
        return person, revoked

    # -- keys in the tree, claims --------------------------------------------------

    async def issue_key(
        self,
        name: str,
        *,
        project: str | None = None,
        owner: str | None = None,
        band: str | None = None,
        expires_at: datetime | None = None,
        claim: bool = False,
        claim_ttl: timedelta = CLAIM_TTL,
    ) -> IssuedKey:
        """A key in a project (an operator's, or a person's there), or a person's personal
        key (owner and no project). Without either, the only project there is."""
        name = check_key_text("name", name, required=True)
        if band is not None and band not in BANDS:
            raise StoreError(f'The band is {", ".join(BANDS)}, not "{band}".')
        now = utcnow()
        if expires_at is not None and expires_at <= now:
            raise StoreError(f"The key expiry {expires_at.isoformat()} is in the past; give a time in the future.")
        if claim and claim_ttl <= timedelta(0):
            raise StoreError("A claim link needs a lifetime above zero.")
        secret = new_secret()
        key_id = "key-" + secrets.token_hex(6)
        async with self._writer.begin() as conn:
            tree = await _load_tree(conn, people=True)
            person = await _find_user(conn, owner) if owner is not None else None
            if person is not None and person.state != "active":
                fix = "`llmgw users approve`" if person.state == "pending" else "`llmgw users reinstate`"
                raise StoreError(f"{person.email} is {person.state}; {fix} first.")
            proj = None
            if project is not None and str(project).strip():
                proj = _find(tree, "project", project)
            elif person is None:
                if len(tree.projects) != 1:
                    listing = ", ".join(sorted(p.path for p in tree.projects.values())) or "none yet"
                    raise StoreError(f"Say which project the key is for with --project (projects: {listing}).")
                (proj,) = tree.projects.values()
            if proj is not None and person is not None and not tree.reaches(person.id, proj):
                raise NotMember(f"{person.email} is not a member of {proj.path}; `llmgw users join` first")
            await conn.execute(
                api_keys.insert().values(
                    id=key_id,
                    name=name,
                    prefix=secret[:PREFIX_LEN],
                    hash=hash_secret(secret),
                    project=proj.path if proj else None,
                    created_at=now,
                    expires_at=expires_at,
                    project_id=proj.id if proj else None,
                    user_id=person.id if person else None,
                    band=band,
                )
            )
            token = claim_expires = None
            if claim:
                token = secrets.token_urlsafe(32)
                claim_expires = now + claim_ttl
                await conn.execute(
                    key_claims.insert().values(
                        token_hash=hash_secret(token),
                        key_id=key_id,
                        sealed=_seal_key(token).encrypt(secret.encode()).decode(),
                        created_at=now,
                        expires_at=claim_expires,
                    )
                )
            await conn.execute(BUMP_GENERATION)
        rec = KeyRecord(
            id=key_id,
            name=name,
            prefix=secret[:PREFIX_LEN],
            hash=None,
            project=proj.path if proj else None,
            created_at=now,
            expires_at=expires_at,
            project_id=proj.id if proj else None,
            user_id=person.id if person else None,
            band=band,
        )
        return IssuedKey(
            secret, rec, proj.path if proj else None, person.email if person else None, token, claim_expires
        )

    async def claim_key(self, token: str) -> str:
        """The secret behind a claim link; works once."""
        if not isinstance(token, str) or not token.strip():
            raise NotFound("This claim link is not valid.")
        now = utcnow()
        async with self._writer.begin() as conn:
            row = (
                await conn.execute(
                    select(key_claims, api_keys.c.revoked_at)
                    .join(api_keys, api_keys.c.id == key_claims.c.key_id)
                    .where(key_claims.c.token_hash == hash_secret(token.strip()))
                )
            ).first()
            if row is None:
                raise NotFound("This claim link is not valid.")
            if row.used_at is not None:
                raise StoreError(
                    f"This claim link was used on {row.used_at:%Y-%m-%d %H:%M} UTC; it works once. Ask for a new key."
                )
            if row.expires_at <= now:
                raise StoreError(f"This claim link expired on {row.expires_at:%Y-%m-%d %H:%M} UTC; ask for a new one.")
            if row.revoked_at is not None:
                raise StoreError("The key behind this claim link was revoked.")
            done = await conn.execute(
                update(key_claims)
                .where(key_claims.c.token_hash == row.token_hash, key_claims.c.used_at.is_(None))
                .values(used_at=now, sealed="")
            )
            if done.rowcount != 1:
                raise StoreError("This claim link was just used; it works once. Ask for a new key.")
        try:
            return _seal_key(token.strip()).decrypt(row.sealed.encode()).decode()
        except InvalidToken:
            raise StoreError("This claim link's key could not be opened.") from None

    # -- limits --------------------------------------------------------------------

    async def set_limits(
        self,
        scope: str,
        ref: str | None,
        *,
        per_member: bool = False,
        rpm: Any = UNSET,
        tpm: Any = UNSET,
        budget_micros: Any = UNSET,
        period: Any = UNSET,
        models: Any = UNSET,
        band: Any = UNSET,
        clear: bool = False,
        changed_by: str | None = None,
    ) -> tuple[str, str, LimitRecord | None]:
        """Write the limits actually given on one level (None clears that one), or with
        clear delete the level's row. Returns (level, scope id, the row now or None).
        Every change is logged (limit_changes) with changed_by (an administrator's email
        from the pages; None from the CLI) and the row before it."""
        if scope not in LIMIT_SCOPES:
            raise StoreError(f'--scope is org, team, project, user or key, not "{scope}"')
        if scope == "key" and not (ref or "").strip():
            raise StoreError("--scope key needs --id, the key's id")
        if per_member and scope not in MEMBER_SCOPES:
            raise StoreError("--per-member is for --scope org, team or project")
        given = {
            k: v
            for k, v in dict(
                rpm=rpm, tpm=tpm, budget_micros=budget_micros, period=period, models=models, band=band
            ).items()
            if v is not UNSET
        }
        if clear and given:
            raise StoreError("--clear removes every limit of the level; give it without other limits.")
        if not clear and not given:
            raise StoreError("Give a limit to set (--rpm, --tpm, --budget, --period, --models, --band) or --clear.")
        for flag, k in (("--rpm", "rpm"), ("--tpm", "tpm"), ("--budget", "budget_micros")):
            if given.get(k) is not None:
                _non_negative(flag, given[k])
        if given.get("period") is not None and given["period"] not in PERIODS:
            raise StoreError(f'--period is day or month, not "{given["period"]}"')
        if given.get("band") is not None:
            if given["band"] not in BANDS:
                raise StoreError(f'--band is {", ".join(BANDS)}, not "{given["band"]}"')
            if scope == "user" or per_member:
                raise StoreError("A band is set on an organization, team, project or key.")
        if given.get("models") is not None:
            ms = given["models"]
            if isinstance(ms, str) or not all(isinstance(m, str) and m.strip() for m in ms):
                raise StoreError("--models is a list of model names (empty allows none).")
            given["models"] = [m.strip() for m in ms]
        level = MEMBER_SCOPES[scope] if per_member else scope
        async with self._writer.begin() as conn:
            if scope in KINDS:
                if not (ref or "").strip():
                    tree = await _load_tree(conn)
                    table = _tables(tree)[scope]
                    if len(table) != 1:
                        raise StoreError(f"Say which {KIND_WORDS[scope]} with --id (its id, path or name).")
                    (scope_id,) = table
                else:
                    scope_id = _find(await _load_tree(conn), scope, ref).id
            elif scope == "user":
                scope_id = (await _find_user(conn, ref)).id
            else:
                assert ref is not None  # a key scope without --id was refused above
                found = (await conn.execute(select(api_keys.c.id).where(api_keys.c.id == ref.strip()))).first()
                if found is None:
                    raise NotFound(f'No key has the id "{ref.strip()}"; `llmgw keys list --all` shows them.')
                scope_id = found.id
                if "band" in given:  # a key's band lives on the key
                    await conn.execute(update(api_keys).where(api_keys.c.id == scope_id).values(band=given.pop("band")))
            where = (limits.c.scope == level, limits.c.scope_id == scope_id)
            old = (await conn.execute(select(limits).where(*where))).first()
            await conn.execute(delete(limits).where(*where))
            row = None
            if not clear:
                values: dict[str, Any] = (
                    {c: old._mapping[c] for c in ("rpm", "tpm", "budget_micros", "period", "models", "band")}
                    if old
                    else {"period": "month"}
                )
                for k, v in given.items():
                    values[k] = _models_text(v) if k == "models" else v
                if values.get("period") is None:
                    values["period"] = "month"
                if any(values.get(c) is not None for c in ("rpm", "tpm", "budget_micros", "models", "band")):
                    await conn.execute(
                        limits.insert().values(scope=level, scope_id=scope_id, updated_at=utcnow(), **values)
                    )
                    row = _limit((await conn.execute(select(limits).where(*where))).one())
            await record_limit_change(conn, changed_by, level, scope_id, _limit(old) if old else None, row)
            await conn.execute(BUMP_GENERATION)
        return level, scope_id, row

    async def get_limits(self, scope: str, scope_id: str) -> LimitRecord | None:
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(select(limits).where(limits.c.scope == scope, limits.c.scope_id == scope_id))
            ).first()
        return _limit(row) if row else None

    # -- what the gateway reads --------------------------------------------------------

    async def tenancy_snapshot(self) -> Tree:
        """The tree, people and every limit, for building principals."""
        return await self.tree(people=True, with_limits=True)

    async def usage_cost_since(self, since: datetime, until: datetime | None = None) -> list[CostRow]:
        """Spend from `since` (to before `until`, when given), per key, person, project, team
        and organization, for restoring budget pools at start: ask for the month before
        today and for today to fill monthly and daily budgets."""
        cols = (usage.c.key_id, usage.c.user_id, usage.c.project_id, usage.c.team_id, usage.c.org_id)
        q = (
            select(*cols, func.sum(usage.c.cost_micros).label("cost"))
            .where(usage.c.at >= since)
            .group_by(*cols)
            .having(func.sum(usage.c.cost_micros) > 0)
        )
        if until is not None:
            q = q.where(usage.c.at < until)
        async with self._engine.connect() as conn:
            return [
                CostRow(r.key_id, r.user_id, r.project_id, r.team_id, r.org_id, int(r.cost))
                for r in await conn.execute(q)
            ]


def describe_memberships(tree: Tree, ms: Sequence[Membership]) -> str:
    """ "Acme (manager), Acme/platform" — what a person is a member of."""
    return ", ".join(tree.path_of(m.scope, m.scope_id) + (" (manager)" if m.role == "manager" else "") for m in ms)
