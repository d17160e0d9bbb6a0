"""Where the mirror keeps things: ``<root>/<model>/<version>/<file>``.

Each of the three is exactly one directory level. Names starting with a dot
are llmgw's own (temporary ``.part`` files, the per-version ``.llmgw.json``)
and are never listed or served, so an operator's hand-copied file can never
collide with them and a half-written download is never mistaken for a model.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_SEGMENT = 200  # leaves room for ".<name>.part" under the 255-byte file-name limit


class MirrorError(Exception):
    """A refusal; the message is a sentence saying what was wrong and how to fix it."""


def check_segment(name: str, what: str) -> str:
    """Return ``name`` if it is one plain directory level, else raise MirrorError.

    ``what`` names the thing for the message ("--model", "file name"), so the
    person reading it knows which of their inputs to change.
    """
    why = None
    if not name or name in (".", ".."):
        why = "is not a name"
    elif "/" in name or "\\" in name:
        why = "contains a path separator; it must be one directory level"
    elif "\x00" in name or any(ord(c) < 32 for c in name):
        why = "contains control characters"
    elif name.startswith("."):
        why = "starts with a dot; such names are the mirror's own bookkeeping and are never served"
    elif len(name) > MAX_SEGMENT:
        why = f"is longer than {MAX_SEGMENT} characters"
    if why:
        raise MirrorError(f"{what} {name!r} {why}; choose another.")
    return name


def resolve_inside(root: Path, *parts: str) -> Path | None:
    """The real path of ``root/parts…`` if it stays inside root's real path, else None.

    Symlinks are resolved first: a link an operator (or anyone) left in the
    tree must not let the mirror serve or delete something outside it.
    """
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(real_root.joinpath(*parts)))
    if target == real_root or real_root in target.parents:
        return target
    return None


def is_hidden(name: str) -> bool:
    return name.startswith(".")
