"""Turning `auth.store` (a path, a postgres:// URL, or @file) into a SQLAlchemy URL."""

from __future__ import annotations

import logging
import os
import re

from sqlalchemy.engine import URL, make_url

from .errors import StoreError, mask_password

log = logging.getLogger("llmgw.store")

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_POSTGRES_SCHEMES = {"postgres", "postgresql", "postgresql+asyncpg"}
_SQLITE_SCHEMES = {"sqlite", "sqlite+aiosqlite"}
# libpq's sslmode values; asyncpg takes the same words, but under the name `ssl`.
_SSLMODES = {"disable", "allow", "prefer", "require", "verify-ca", "verify-full"}
# Query parameters asyncpg.connect() accepts as keywords; anything else would fail at
# connect time with a TypeError, so it is refused here with a readable message.
_ASYNCPG_PARAMS = {"ssl", "timeout", "command_timeout", "host", "port", "prepared_statement_cache_size"}
# Seconds; the asyncpg dialect passes query values on as strings, so Store converts these.
NUMERIC_PARAMS = ("timeout", "command_timeout")
_HINT = (
    "give a file path for SQLite (for example ~/.local/share/llmgw/llmgw.db), "
    "postgresql://user:password@host:5432/dbname for PostgreSQL, "
    "or @/path/to/file to read the address from a file"
)


def resolve_store_address(addr: str) -> str:
    """Return the SQLAlchemy URL (async drivers) for a store address; raise StoreError."""
    if not isinstance(addr, str):
        raise StoreError(f"The store address must be a string, not {type(addr).__name__}; {_HINT}.")
    text = addr.strip()
    if not text:
        raise StoreError(f"The store address is empty; {_HINT}.")
    if text.startswith("@"):
        return _resolve(_read_address_file(text[1:]), f" (read from {text[1:].strip()})")
    return _resolve(text, "")


def _read_address_file(name: str) -> str:
    name = name.strip()
    if not name:
        raise StoreError(
            "The store address '@' names no file; write @/path/to/file, where the file holds the address on one line."
        )
    path = os.path.abspath(os.path.expanduser(name))
    try:
        with open(path, encoding="utf-8") as f:
            content = f.read().strip()
    except FileNotFoundError:
        raise StoreError(
            f"The store address file {path} does not exist; create it with the "
            "address on one line, or give the address directly."
        ) from None
    except IsADirectoryError:
        raise StoreError(
            f"The store address file {path} is a directory; point @ at a file that holds the address."
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise StoreError(
            f"The store address file {path} could not be read ({e}); check its permissions and that it is UTF-8 text."
        ) from None
    if not content:
        raise StoreError(
            f"The store address file {path} is empty; write the address (a path or a postgresql:// URL) into it."
        )
    if content.startswith("@"):
        # One level only: a chain of files is more likely a mistake than a plan.
        raise StoreError(
            f"The store address file {path} holds another @ reference; put the address itself in the file."
        )
    return content


def _resolve(text: str, origin: str) -> str:
    m = _SCHEME_RE.match(text)
    if m is None:
        return _sqlite_url(text, origin)
    scheme = m.group(1).lower()
    if scheme in _POSTGRES_SCHEMES:
        return _postgres_url(text, m.end(), origin)
    if scheme in _SQLITE_SCHEMES:
        # Accept an already resolved SQLite URL so resolving is idempotent.
        database = make_url(text).database
        if not database:
            raise StoreError(f"The store address {text}{origin} names no database file; {_HINT}.")
        return _sqlite_url(database, origin)
    raise StoreError(
        f"The store address {mask_password(text)}{origin} uses the unsupported scheme '{m.group(1)}://'; {_HINT}."
    )


def _sqlite_url(path: str, origin: str) -> str:
    if path == ":memory:" or path.startswith("file:"):
        # A pooled async engine would give each connection its own memory database.
        raise StoreError(
            f"The store address {path}{origin} is not a file path; in-memory and "
            "URI-style SQLite databases are not supported, give a file path."
        )
    full = os.path.abspath(os.path.expanduser(path))
    if path.endswith(("/", os.sep)) or os.path.isdir(full):
        raise StoreError(
            f"The store address {path}{origin} is a directory; give a file "
            f"inside it, for example {os.path.join(full, 'llmgw.db')}."
        )
    directory = os.path.dirname(full)
    if not os.path.isdir(directory):
        # Created, not refused: a first start on a fresh machine needs it. Said so, because
        # a mistyped path also lands here, and would start on an empty store without keys.
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"Could not create the directory for the SQLite store {full}{origin} "
                f"({e.strerror or e}); create it or choose another path."
            ) from None
        log.warning(
            "created %s for the SQLite store %s: it did not exist (if that path is a typo, "
            "fix auth.store; this store starts empty)",
            directory,
            full,
        )
    return URL.create("sqlite+aiosqlite", database=full).render_as_string(hide_password=False)


def _postgres_url(text: str, rest_at: int, origin: str) -> str:
    shown = mask_password(text) + origin
    try:
        url = make_url("postgresql+asyncpg://" + text[rest_at:])
    except (ValueError, TypeError) as e:
        raise StoreError(
            f"The PostgreSQL address {shown} could not be parsed ({mask_password(str(e))}); "
            "write it as postgresql://user:password@host:5432/dbname."
        ) from None
    if not url.database:
        raise StoreError(
            f"The PostgreSQL address {shown} names no database; add it after "
            "the host, as in postgresql://user:password@host:5432/dbname."
        )
    query: dict[str, str] = {}
    for given, value in url.query.items():
        key = given
        if not isinstance(value, str):
            raise StoreError(f"The PostgreSQL address {shown} gives '{key}' more than once; keep one.")
        if key == "sslmode":
            if value not in _SSLMODES:
                raise StoreError(
                    f"The PostgreSQL address {shown} has sslmode={value}; use one of {', '.join(sorted(_SSLMODES))}."
                )
            key = "ssl"
        elif key == "connect_timeout":
            key = "timeout"  # libpq's name for what asyncpg calls timeout
        elif key not in _ASYNCPG_PARAMS:
            raise StoreError(
                f"The PostgreSQL address {shown} has the parameter '{key}', which the "
                f"asyncpg driver does not take; supported: sslmode, connect_timeout, "
                f"{', '.join(sorted(_ASYNCPG_PARAMS))}."
            )
        if key in NUMERIC_PARAMS:
            try:
                if not float(value) > 0:
                    raise ValueError
            except ValueError:
                raise StoreError(
                    f"The PostgreSQL address {shown} has {given}={value}; give a number of seconds greater than zero."
                ) from None
        if key == "prepared_statement_cache_size" and not (value.isdigit()):
            raise StoreError(
                f"The PostgreSQL address {shown} has {given}={value}; give a "
                "whole number (0 turns the cache off, as PgBouncer needs)."
            )
        if key in query:
            raise StoreError(
                f"The PostgreSQL address {shown} sets '{key}' twice (sslmode is "
                "libpq's name for ssl, connect_timeout for timeout); keep one."
            )
        query[key] = value
    return url.set(query=query).render_as_string(hide_password=False)
