"""API key rows and secrets, shared by the key and tenancy parts of the store."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, Literal, overload

from sqlalchemy.engine import Row

from .errors import StoreError
from .records import KeyRecord
from .schema import api_keys

SECRET_PREFIX = "llmgw-"
PREFIX_LEN = 14  # the visible part of a secret: "llmgw-" and 8 random characters
MAX_TEXT_LEN = 200  # key names and projects
KEY_COLS = [c for c in api_keys.c if c.name != "hash"]


def hash_secret(secret: str) -> str:
    """The stored form of an API key secret: sha256, hex. Secrets are random enough
    (240 bits) that a slow password hash would buy nothing and cost every request."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(30)  # 30 bytes -> exactly 40 characters


@overload
def check_key_text(what: str, value: object, required: Literal[True]) -> str: ...
@overload
def check_key_text(what: str, value: object, required: bool) -> str | None: ...


def check_key_text(what: str, value: object, required: bool) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise StoreError(f"The key {what} must be text, not {type(value).__name__}.")
    value = value.strip()
    if not value:
        raise StoreError(
            f"The key {what} is empty; give a short {what} (for example the team or app that will use the key)."
        )
    if len(value) > MAX_TEXT_LEN:
        raise StoreError(f"The key {what} is {len(value)} characters long; keep it to at most {MAX_TEXT_LEN}.")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise StoreError(f"The key {what} contains control characters (such as a newline); use plain text on one line.")
    return value


def key_from_row(row: Row[Any], with_hash: bool = False) -> KeyRecord:
    m = row._mapping
    return KeyRecord(
        id=m["id"],
        name=m["name"],
        prefix=m["prefix"],
        hash=m["hash"] if with_hash else None,
        project=m["project"],
        created_at=m["created_at"],
        revoked_at=m["revoked_at"],
        last_used_at=m["last_used_at"],
        expires_at=m["expires_at"],
        project_id=m["project_id"],
        user_id=m["user_id"],
        band=m["band"],
    )
