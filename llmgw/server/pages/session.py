"""Who is looking at a page: the browser session, its CSRF token, and the guard every page route has.

* A session is a random token in an ``HttpOnly``, ``SameSite=Lax`` cookie
  (``Secure`` when the request came over https, as ``X-Forwarded-Proto`` says
  behind a proxy); the store keeps only its hash.
* Page routes read the cookie and nothing else: an API key in ``Authorization``
  opens no page. API routes never read the cookie (the gateway does not look at
  it), so a browser that is signed in cannot call the API by visiting a page.
* Every form carries a CSRF token: the session's own once signed in (rotated
  after a password change), and before that (sign-in, sign-up) a token in a
  short cookie of its own that the form must repeat. A form whose Origin is
  another site is refused before that.
* The guard is a decorator on each page handler, not a middleware, so the API's
  request path does not pay for the pages.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from aiohttp import web
from sqlalchemy import select

from llmgw.store import Store
from llmgw.store.records import User
from llmgw.store.schema import memberships

SESSION_COOKIE = "llmgw_session"
FORM_COOKIE = "llmgw_form"  # the CSRF token of forms shown before there is a session

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Cookie = tuple[str, str, dict[str, Any]]


@dataclass(frozen=True)
class Visitor:
    user: User
    csrf: str
    token: str  # the session's own token (from the cookie), to end or rotate it
    manages: bool = False  # manages an organization: the menu shows them its "manager" items


VISITOR = web.RequestKey("llmgw_visitor", Visitor)
SET_COOKIES = web.RequestKey("llmgw_set_cookies", list[Cookie])
FORM_CSRF = web.RequestKey("llmgw_form_csrf", str)


def current(request: web.Request) -> Visitor | None:
    return request.get(VISITOR)


def pending_cookies(request: web.Request) -> list[Cookie]:
    if SET_COOKIES not in request:
        request[SET_COOKIES] = []
    return request[SET_COOKIES]


def is_https(request: web.Request) -> bool:
    proto = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return proto == "https" or request.secure


def cookie_options(request: web.Request, max_age: int | None) -> dict[str, Any]:
    opts: dict[str, Any] = {"path": "/", "httponly": True, "samesite": "Lax", "secure": is_https(request)}
    if max_age is not None:
        opts["max_age"] = max_age
    return opts


def set_cookie(request: web.Request, name: str, value: str, max_age: int | None) -> None:
    """A cookie the next rendered page (or redirect made by :func:`redirect`) sets."""
    pending_cookies(request).append((name, value, cookie_options(request, max_age)))


def redirect(request: web.Request, to: str) -> web.Response:
    resp = web.Response(status=303, headers={"Location": to, "Cache-Control": "no-store"})
    for name, value, opts in request.get(SET_COOKIES, []):
        if value == "":
            resp.del_cookie(name, path="/")
        else:
            resp.set_cookie(name, value, **opts)
    return resp


def local_target(value: str | None, default: str) -> str:
    """A ``next=`` address only when it is a path on this site (never //host or a scheme)."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return default
    parts = urlsplit(value)
    return value if not parts.scheme and not parts.netloc else default


def foreign_origin(request: web.Request) -> bool:
    """A form sent by a page of another site (the browser says so in Origin or Sec-Fetch-Site)."""
    if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
        return True
    origin = request.headers.get("Origin")
    if not origin or origin == "null":
        return origin == "null"
    host = request.headers.get("X-Forwarded-Host") or request.host
    return urlsplit(origin).netloc.lower() != host.split(",")[0].strip().lower()


class Sessions:
    """The guard and the session's life: find it, start it, end it."""

    def __init__(self, store: Store, ttl: float) -> None:
        self.store = store
        self.ttl = ttl

    async def visitor(self, request: web.Request) -> Visitor | None:
        token = request.cookies.get(SESSION_COOKIE)
        if not token or len(token) > 200 or not token.isascii():
            return None
        found = await self.store.session_user(token)
        if found is None:
            return None
        record, user = found
        manages = not user.admin and await self._manages(user.id)
        return Visitor(user=user, csrf=record.csrf, token=token, manages=manages)

    async def _manages(self, user_id: str) -> bool:
        """Whether the person manages an organization (one indexed lookup; administrators see those items anyway)."""
        q = (
            select(memberships.c.scope_id)
            .where(memberships.c.user_id == user_id, memberships.c.role == "manager")
            .limit(1)
        )
        async with self.store.engine.connect() as conn:
            return (await conn.scalar(q)) is not None

    async def start(self, request: web.Request, user: User) -> None:
        token, _ = await self.store.create_session(user.id, self.ttl)
        set_cookie(request, SESSION_COOKIE, token, int(self.ttl))
        set_cookie(request, FORM_COOKIE, "", 0)

    async def end(self, request: web.Request, visitor: Visitor) -> None:
        await self.store.end_session(visitor.token)
        pending_cookies(request).append((SESSION_COOKIE, "", {}))

    def guard(self, who: str, refuse: Callable[[web.Request, int, str], web.StreamResponse]):
        """``who``: "open" (anyone; the visitor is known when signed in), "session" (signed in), "admin".
        POSTs also need their CSRF token and a same-site origin."""

        def wrap(handler: Handler) -> Handler:
            async def guarded(request: web.Request) -> web.StreamResponse:
                visitor = await self.visitor(request)
                if visitor is not None:
                    request[VISITOR] = visitor
                if who != "open" and visitor is None:
                    if request.method == "GET":
                        return redirect(request, "/login?next=" + quote(request.path_qs, safe="/?=&"))
                    return refuse(request, 401, "You are not signed in (or your session ended); sign in again.")
                if who == "admin" and visitor is not None and not visitor.user.admin:
                    return refuse(request, 403, "This page is for administrators.")
                if request.method not in ("GET", "HEAD"):
                    bad = await self._form_refusal(request, visitor)
                    if bad:
                        return refuse(request, 403, bad)
                elif visitor is None:
                    self._form_token(request)
                return await handler(request)

            guarded.__name__ = handler.__name__
            guarded.llmgw_guard = who  # type: ignore[attr-defined]  # read by the route-guard test
            return guarded

        return wrap

    def _form_token(self, request: web.Request) -> None:
        """The token a form shown before sign-in repeats: the cookie's, or a new one."""
        token = request.cookies.get(FORM_COOKIE)
        if not token or len(token) > 100 or not token.isascii():
            token = secrets.token_urlsafe(24)
            set_cookie(request, FORM_COOKIE, token, 3600)
        request[FORM_CSRF] = token

    async def _form_refusal(self, request: web.Request, visitor: Visitor | None) -> str | None:
        if foreign_origin(request):
            return "This form was sent from another site, so it was refused."
        if request.content_type == "application/json":
            sent = request.headers.get("X-CSRF-Token", "")
        else:
            form = await request.post()
            sent = str(form.get("csrf", ""))
        want = visitor.csrf if visitor is not None else request.cookies.get(FORM_COOKIE, "")
        if not want or not sent or not hmac.compare_digest(sent.encode(), want.encode()):
            self._form_token(request) if visitor is None else None
            return "This form's security token is missing or out of date: reload the page and send it again."
        if visitor is None:
            request[FORM_CSRF] = want
        return None
