"""Where the mirror keeps things: ``<root>/<model>/<version>/<file>``.

Each of the three is exactly one directory level. Names starting with a dot
are llmgw's own (temporary ``.part`` files, the per-version ``.llmgw.json``)
and are never listed or served, so an operator's hand-copied file can never
collide with them and a half-written download is never mistaken for a model.
"""

from __future__ import annotations

from llmgw.download import PART_SUFFIX
from llmgw.errors import LlmgwError
from llmgw.paths import segment_problem

MAX_SEGMENT = 200  # leaves room for ".<name>.part" under the 255-byte file-name limit


class MirrorError(LlmgwError):
    """A refusal; the message is a sentence saying what was wrong and how to fix it."""


def check_segment(name: str, what: str) -> str:
    """Return ``name`` if it is one plain directory level, else raise MirrorError.

    ``what`` names the thing for the message ("--model", "file name"), so the
    person reading it knows which of their inputs to change.
    """
    # Room for the ".<name>.part" it is downloaded under.
    why = segment_problem(name, room=1 + len(PART_SUFFIX))
    if why is None and name.startswith("."):
        why = "starts with a dot; such names are the mirror's own bookkeeping and are never served"
    elif why is None and len(name) > MAX_SEGMENT:
        why = f"is longer than {MAX_SEGMENT} characters"
    if why:
        raise MirrorError(f"{what} {name!r} {why}; choose another.")
    return name


def is_hidden(name: str) -> bool:
    return name.startswith(".")
