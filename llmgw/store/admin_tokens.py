"""Admin tokens: the credential of the admin API, mixed into Store.

Random, shown once, kept as sha256 with a visible prefix, several at once,
revocable. Their prefix differs from API keys' so neither is mistaken for the
other (and they live in different tables: an API key never opens the admin API).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.files import new_token, token_digest, write_secret_file

from .errors import Ambiguous, NotFound, StoreError
from .keyrows import check_key_text
from .records import utcnow
from .schema import admin_tokens

TOKEN_PREFIX = "llmgw-admin-"
TOKEN_PREFIX_LEN = len(TOKEN_PREFIX) + 8  # the visible part: the prefix and 8 random characters
MIN_MATCH_LEN = 6
# last_used_at is a hint for `ctl token list`, not an audit log: written at most this often.
_TOUCH_EVERY = timedelta(minutes=1)


@dataclass(frozen=True, slots=True)
class AdminToken:
    id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None


def _token(row: Row[Any]) -> AdminToken:
    m = row._mapping
    return AdminToken(
        id=m["id"],
        name=m["name"],
        prefix=m["prefix"],
        created_at=m["created_at"],
        revoked_at=m["revoked_at"],
        last_used_at=m["last_used_at"],
    )


_COLS = [c for c in admin_tokens.c if c.name != "hash"]


class AdminTokensMixin:
    _engine: AsyncEngine
    _writer: AsyncEngine

    async def create_admin_token(self, name: str) -> tuple[str, AdminToken]:
        """A new token; returns (secret, record). The secret is kept nowhere."""
        checked = check_key_text("name", name, required=True)
        assert checked is not None  # required: refused above when missing
        name = checked
        secret = new_token(TOKEN_PREFIX)
        rec = AdminToken(
            id="adm-" + secrets.token_hex(6), name=name, prefix=secret[:TOKEN_PREFIX_LEN], created_at=utcnow()
        )
        async with self._writer.begin() as conn:
            await conn.execute(
                admin_tokens.insert().values(
                    id=rec.id, name=rec.name, prefix=rec.prefix, hash=token_digest(secret), created_at=rec.created_at
                )
            )
        return secret, rec

    async def list_admin_tokens(self, include_revoked: bool = False) -> list[AdminToken]:
        q = select(*_COLS).order_by(admin_tokens.c.created_at, admin_tokens.c.id)
        if not include_revoked:
            q = q.where(admin_tokens.c.revoked_at.is_(None))
        async with self._engine.connect() as conn:
            return [_token(r) for r in await conn.execute(q)]

    async def admin_token_by_secret(self, secret: str) -> AdminToken | None:
        """The active token with this secret, or None; notes its use (at most once a minute)."""
        if not secret.startswith(TOKEN_PREFIX):
            return None
        digest = token_digest(secret)
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(
                    select(*_COLS).where(admin_tokens.c.hash == digest, admin_tokens.c.revoked_at.is_(None))
                )
            ).first()
        if row is None:
            return None
        tok = _token(row)
        now = utcnow()
        if tok.last_used_at is None or now - tok.last_used_at > _TOUCH_EVERY:
            try:
                async with self._writer.begin() as conn:
                    await conn.execute(update(admin_tokens).where(admin_tokens.c.id == tok.id).values(last_used_at=now))
            except Exception:
                pass
        return tok

    async def revoke_admin_token(self, ref: str) -> AdminToken:
        """Revoke by id, by the start of the visible prefix (at least 6 characters), or by the
        secret itself. Raises NotFound or Ambiguous and then changes nothing."""
        query = ref.strip() if isinstance(ref, str) else ""
        if not query:
            raise NotFound("give the id of the admin token to revoke (adm-…) or the start of its prefix")
        cond = admin_tokens.c.id == query
        if query.startswith(TOKEN_PREFIX) and len(query) > TOKEN_PREFIX_LEN:
            cond = or_(cond, admin_tokens.c.hash == token_digest(query))
            shown = query[:TOKEN_PREFIX_LEN] + "…"  # a pasted secret is never echoed
        else:
            shown = query
            if len(query) >= MIN_MATCH_LEN:
                cond = or_(cond, func.substr(admin_tokens.c.prefix, 1, len(query)) == query)
        async with self._writer.begin() as conn:
            found = [_token(r) for r in await conn.execute(select(*_COLS).where(cond))]
            exact = [t for t in found if t.id == query]
            found = exact or found
            if not found:
                raise NotFound(f"no admin token matches '{shown}'; `llmgw ctl token list` shows their ids and prefixes")
            if len(found) > 1:
                raise Ambiguous(
                    f"'{shown}' matches {len(found)} admin tokens "
                    f"({', '.join(t.id for t in found)}); give the id of the one to revoke",
                    [t.id for t in found],
                )
            tok = found[0]
            if tok.revoked_at is not None:
                raise StoreError(
                    f"the admin token {tok.id} ({tok.name!r}) was already revoked at "
                    f"{tok.revoked_at:%Y-%m-%d %H:%M} UTC; nothing changed"
                )
            now = utcnow()
            await conn.execute(update(admin_tokens).where(admin_tokens.c.id == tok.id).values(revoked_at=now))
        return AdminToken(tok.id, tok.name, tok.prefix, tok.created_at, now, tok.last_used_at)


async def ensure_token_file(store: AdminTokensMixin, path: str | os.PathLike[str], name: str) -> bool:
    """The admin token file `llmgw ctl` reads on the control plane: made (a new token, mode 0600)
    when missing, else left alone, even if its token was revoked (that was someone's decision).

    Returns whether it was made. Shared by the server's first start and `llmgw server init`.
    OSError from writing propagates, after the token just made is revoked.
    """
    if os.path.exists(path):
        return False
    secret, rec = await store.create_admin_token(name)
    try:
        write_secret_file(path, secret)
    except OSError:
        await store.revoke_admin_token(rec.id)
        raise
    return True
