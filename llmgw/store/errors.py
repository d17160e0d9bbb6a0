"""Errors the store raises; each message says what was wrong and how to fix it."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from llmgw.errors import LlmgwError

if TYPE_CHECKING:
    from .records import KeyRecord


class StoreError(LlmgwError):
    """The store could not do what was asked; the message is meant for the user."""


class QuotaFull(StoreError):
    """A write the project's storage quota (server.yaml agents.quota_*) has no room for; nothing
    was written. ``status``: 413 when the one item is larger than the whole quota, else 429;
    ``code`` names the quota (storage_quota_items, storage_quota_bytes)."""

    def __init__(self, message: str, status: int, code: str):
        super().__init__(message)
        self.status = status
        self.code = code


class KeyNotFound(StoreError):
    """No key matched the given id or prefix."""


class AmbiguousKey(StoreError):
    """More than one key matched; `candidates` lists them."""

    def __init__(self, message: str, candidates: list[KeyRecord]):
        super().__init__(message)
        self.candidates = candidates


class KeyAlreadyRevoked(StoreError):
    """The key was revoked before; `key` carries its record (with revoked_at)."""

    def __init__(self, message: str, key: KeyRecord):
        super().__init__(message)
        self.key = key


# scheme://user:PASSWORD@ — the password may hold an unescaped "@", so take the last one
# before the path; greedy matching with backtracking does that.
_PASSWORD_RE = re.compile(r"(?P<pre>\b[A-Za-z][A-Za-z0-9+.\-]*://[^:/?#@\s]*:)[^\s/?#]*@")


def mask_password(text: str) -> str:
    """Replace the password of every URL in `text` with ***."""
    return _PASSWORD_RE.sub(r"\g<pre>***@", text)


class NotFound(StoreError):
    """An id, path, name or email named nothing."""


class Ambiguous(StoreError):
    """A name matched more than one thing; `paths` lists them."""

    def __init__(self, message: str, paths: list[str]):
        super().__init__(message)
        self.paths = paths


class NotMember(StoreError):
    """A person's key was asked for in a project no membership of theirs reaches."""
