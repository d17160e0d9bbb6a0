"""Browser sessions for the web pages, mixed into Store.

A session is a random token the browser holds in a cookie; the store keeps only its
sha256 (as for API keys and admin tokens), so a copy of the database signs nobody in.
Each session carries a CSRF token for its forms, kept as is: it opens nothing alone.
"""

from __future__ import annotations

import math
import secrets
from datetime import timedelta
from typing import Any

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.engine import Row
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.files import token_digest

from .errors import NotFound, StoreError
from .records import SessionRecord, User, utcnow
from .schema import UTCDateTime, browser_sessions, users

# last_seen_at is a hint for the pages, not an audit log: written at most this often, so a
# signed-in browser does not cost a write per request.
TOUCH_EVERY = timedelta(minutes=1)
# A cookie is at most a few KB; anything longer is not one of our tokens (and is not hashed).
_MAX_TOKEN_LEN = 256
_SESSION_COLS = [c for c in browser_sessions.c if c.name != "token_hash"]
# One round trip per page view: the session and its person, who must be active.
_LIVE_SESSION = (
    select(*_SESSION_COLS, *(c.label("u_" + c.name) for c in users.c if c.name != "password_hash"))
    .join(users, users.c.id == browser_sessions.c.user_id)
    .where(
        browser_sessions.c.token_hash == bindparam("digest"),
        browser_sessions.c.expires_at > bindparam("now", type_=UTCDateTime()),
        users.c.state == "active",
    )
)


def _digest(token: object) -> str | None:
    if not isinstance(token, str) or not token or len(token) > _MAX_TOKEN_LEN:
        return None
    return token_digest(token)


def _session(row: Row[Any]) -> SessionRecord:
    m = row._mapping
    return SessionRecord(
        id=m["id"],
        user_id=m["user_id"],
        csrf=m["csrf"],
        created_at=m["created_at"],
        last_seen_at=m["last_seen_at"],
        expires_at=m["expires_at"],
    )


class SessionsMixin:
    _engine: AsyncEngine
    _writer: AsyncEngine

    async def create_session(self, user_id: str, ttl_s: float) -> tuple[str, SessionRecord]:
        """A new session for an active person, lasting ttl_s seconds from now; returns
        (token, record). The token is shown only here. Expired sessions are swept."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise StoreError(f"A session lifetime is a number of seconds above zero, not {ttl_s!r}.")
        token = secrets.token_urlsafe(32)
        now = utcnow()
        rec = SessionRecord(
            id="ses-" + secrets.token_hex(8),
            user_id=user_id,
            csrf=secrets.token_urlsafe(32),
            created_at=now,
            last_seen_at=now,
            expires_at=now + timedelta(seconds=ttl_s),
        )
        async with self._writer.begin() as conn:
            state = await conn.scalar(select(users.c.state).where(users.c.id == user_id))
            if state is None:
                raise NotFound(f'No person has the id "{user_id}".')
            if state != "active":
                raise StoreError(f"Only an active account signs in; {user_id} is {state}.")
            # Swept here: sign-ins are rare next to page views, and each one keeps the table
            # from growing by the sessions nobody signed out of.
            await conn.execute(delete(browser_sessions).where(browser_sessions.c.expires_at <= now))
            await conn.execute(
                browser_sessions.insert().values(
                    id=rec.id,
                    token_hash=token_digest(token),
                    user_id=rec.user_id,
                    csrf=rec.csrf,
                    created_at=rec.created_at,
                    last_seen_at=rec.last_seen_at,
                    expires_at=rec.expires_at,
                )
            )
        return token, rec

    async def session_user(self, token: str, now_touch: bool = True) -> tuple[SessionRecord, User] | None:
        """The live session named by the token and its person; None when the token is
        unknown or expired, or the person is not active. With now_touch, last_seen_at
        moves to now when it is more than a minute old."""
        digest = _digest(token)
        if digest is None:
            return None
        now = utcnow()
        async with self._engine.connect() as conn:
            row = (await conn.execute(_LIVE_SESSION, {"digest": digest, "now": now})).first()
        if row is None:
            return None
        rec = _session(row)
        m = row._mapping
        person = User(
            id=m["u_id"],
            email=m["u_email"],
            name=m["u_name"],
            state=m["u_state"],
            admin=bool(m["u_admin"]),
            created_at=m["u_created_at"],
        )
        if now_touch and now - rec.last_seen_at >= TOUCH_EVERY:
            try:
                async with self._writer.begin() as conn:
                    await conn.execute(
                        update(browser_sessions)
                        .where(browser_sessions.c.id == rec.id, browser_sessions.c.last_seen_at < now)
                        .values(last_seen_at=now)
                    )
                rec = SessionRecord(rec.id, rec.user_id, rec.csrf, rec.created_at, now, rec.expires_at)
            except SQLAlchemyError:
                pass  # a busy store must not turn a page view into an error over a hint
        return rec, person

    async def end_session(self, token: str) -> None:
        """Sign out: forget the session. An unknown or expired token is fine."""
        digest = _digest(token)
        if digest is None:
            return
        async with self._writer.begin() as conn:
            await conn.execute(delete(browser_sessions).where(browser_sessions.c.token_hash == digest))

    async def end_sessions(self, user_id: str, except_token: str | None = None) -> int:
        """Sign a person out everywhere (but in the session except_token names, when
        given); returns how many sessions ended."""
        q = delete(browser_sessions).where(browser_sessions.c.user_id == user_id)
        keep = _digest(except_token)
        if keep is not None:
            q = q.where(browser_sessions.c.token_hash != keep)
        async with self._writer.begin() as conn:
            return (await conn.execute(q)).rowcount

    async def rotate_csrf(self, token: str) -> str:
        """Give the live session a new CSRF token (after a password change) and return it;
        forms carrying the old one are refused from now on."""
        digest = _digest(token)
        csrf = secrets.token_urlsafe(32)
        if digest is not None:
            async with self._writer.begin() as conn:
                done = await conn.execute(
                    update(browser_sessions)
                    .where(browser_sessions.c.token_hash == digest, browser_sessions.c.expires_at > utcnow())
                    .values(csrf=csrf)
                )
            if done.rowcount == 1:
                return csrf
        raise NotFound("This session has ended; sign in again.")
