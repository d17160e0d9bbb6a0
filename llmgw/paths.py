"""Names from outside (a request path, a manifest, a URL, an archive entry) checked before they touch the disk.

One definition of what a plain name is, what a clean relative path is, and
what "inside a directory" means once links are followed. Each caller adds
its own rules on top (the mirror hides dot-names, the weights cache keeps
its own suffixes) and its own error and wording, but none decides on its
own what a separator, a ``..`` or an escape through a link is.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.errors import LlmgwError

MAX_NAME_BYTES = 255  # one name on Linux file systems


class PathRefused(LlmgwError, ValueError):
    """A path from outside is refused; the message says why, worded to follow the path itself."""


def segment_problem(name: str, *, room: int = 0) -> str | None:
    """Why ``name`` is not one plain name, one directory level; None when it is one.

    ``room`` is what the caller may add to the name on disk (a ``.part``
    suffix, say), counted against the file-name limit so the longer name
    still fits.
    """
    if not name or name in (".", ".."):
        return "is not a name"
    if "/" in name or "\\" in name:
        return "contains a path separator, so it could lead outside its directory"
    if any(ord(c) < 32 for c in name):
        return "contains control characters"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid text"
    if size + room > MAX_NAME_BYTES:
        return "is too long for a file name"
    return None


def relative_path(raw: str, *, within: str = "its directory") -> str:
    """``raw`` as a clean relative POSIX path (``""`` for the directory itself).

    Empty and ``.`` steps are dropped; anything that could lead elsewhere
    raises PathRefused: an absolute path, a ``..`` step, a backslash (which
    some tools take for a separator), a NUL byte. ``within`` names the
    directory for the message.
    """
    if "\x00" in raw:
        raise PathRefused("has a NUL byte in its name")
    if "\\" in raw:
        raise PathRefused("has a backslash in its path")
    if raw.startswith("/"):
        raise PathRefused("is an absolute path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathRefused(f"climbs out of {within} with '..'")
    return "/".join(parts)


def inside(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is ``root`` or beneath it, with the links of both followed.

    A link left in the tree (by an operator, an earlier archive, anyone)
    must not make a path that looks inside lead out of it.
    """
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    return real == real_root or real_root in real.parents


def resolve_inside(root: str | os.PathLike[str], *parts: str) -> Path | None:
    """The real path of ``root/parts…`` when it stays inside root's real path, else None."""
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(real_root.joinpath(*parts)))
    return target if inside(real_root, target) else None
