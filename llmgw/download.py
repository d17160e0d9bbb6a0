"""The one resumable HTTP download: what is asked, what an answer means, where the bytes go.

Two HTTP clients do the socket work, each where DESIGN.md puts it: aiohttp
in the agent (the weights cache, engine archives), httpx in the mirror
(Hugging Face, with every redirect checked by its source policy). All the
rest of a download is here, as functions both follow, so the two cannot
disagree about it:

* the bytes arrive under a temporary name beside the target
  (:func:`part_path`) and take the target's name only when whole, through
  ``llmgw.files.replace_durably``;
* every request asks for the bytes as stored (:func:`request_headers`):
  a compressed body would make Content-Length and Range count other bytes;
* a partial file is resumed with ``Range: bytes=N-`` from
  :func:`resume_from`, and :func:`read_answer` says what the answer means:
  a 206 must start where the partial ends, a 416 may mean the partial is
  already whole, a 200 is the whole file again;
* the length an answer promises is checked against the caller's own list
  and the free disk space (:func:`lacking_space`) before a byte is written,
  and each chunk against that length as it comes (:func:`overruns`).
"""

from __future__ import annotations

import contextlib
import enum
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

PART_SUFFIX = ".part"
CHUNK = 1 << 20  # what is read or written at a time

# RFC 9110 §14.4: "bytes first-last/complete", or "bytes */complete" on a 416.
_CONTENT_RANGE = re.compile(r"^bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)$", re.IGNORECASE)


def part_path(target: Path, *, hidden: bool = False) -> Path:
    """Where ``target``'s bytes arrive until it is whole: ``<name>.part`` beside it,
    or ``.<name>.part`` where a directory's dot-names are never listed or served."""
    return target.with_name(f"{'.' if hidden else ''}{target.name}{PART_SUFFIX}")


def resume_from(part: Path, expected: int | None) -> int:
    """How many bytes of ``part`` a resume keeps: its size, or 0 (and it is deleted)
    when it is longer than the file can be, so it is no prefix of it."""
    try:
        have = part.stat().st_size
    except FileNotFoundError:
        return 0
    if expected is not None and have > expected:
        with contextlib.suppress(FileNotFoundError):
            part.unlink()
        return 0
    return have


def request_headers(have: int) -> dict[str, str]:
    """The headers of a GET for the bytes after the first ``have``."""
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    return headers


@dataclass(frozen=True)
class ContentRange:
    start: int | None  # None in "bytes */N", a 416's answer
    end: int | None
    total: int | None  # None in "bytes a-b/*": the length is not known


def parse_content_range(value: str | None) -> ContentRange | None:
    """A Content-Range header, or None when it is missing or not one (a range
    that ends before it starts, or past the length it gives)."""
    m = _CONTENT_RANGE.match(value.strip()) if value else None
    if not m:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    if m.group(1) is None:
        return ContentRange(None, None, total) if total is not None else None
    start, end = int(m.group(1)), int(m.group(2))
    if end < start or (total is not None and end >= total):
        return None
    return ContentRange(start, end, total)


def parse_length(value: str | None) -> int | None:
    """A Content-Length header, or None when it is missing or not a number."""
    v = value.strip() if value else ""
    return int(v) if v.isdigit() else None


class Step(enum.Enum):
    WHOLE = "whole"  # a 416 to a resume, and the partial is the whole file: rename it
    RESTART = "restart"  # this answer cannot extend the partial: delete it, ask from byte 0
    APPEND = "append"  # a 206 from where the partial ends: append the body
    WRITE = "write"  # a 200: the body is the whole file, written from the start
    WRONG_LENGTH = "wrong_length"  # the file is not the length the caller was told
    OTHER = "other"  # any other status: the caller's to judge


@dataclass(frozen=True)
class Answer:
    step: Step
    # The whole file's length: what the answer says, else what the caller
    # expected; for WRONG_LENGTH what the answer says.
    total: int | None = None
    have: int = 0  # the bytes already held that the body continues
    why: str = ""  # for RESTART: what was wrong, to log or say


def read_answer(
    status: int, have: int, content_range: str | None, content_length: str | None, expected: int | None = None
) -> Answer:
    """What an answer to :func:`request_headers` ``(have)`` means for the partial file.

    ``expected`` is the length the caller was told (a manifest's, Hugging
    Face's), or None.
    """
    if status == 416 and have:
        cr = parse_content_range(content_range)
        if cr is not None and cr.total == have and expected in (None, have):
            return Answer(Step.WHOLE, total=have, have=have)
        return Answer(Step.RESTART, why=f"refused to resume at byte {have}")
    if status == 206:
        cr = parse_content_range(content_range)
        if cr is None or cr.start is None:
            return Answer(
                Step.RESTART, why=f"sent part of the file with an unreadable Content-Range ({content_range!r})"
            )
        if cr.start != have:
            return Answer(Step.RESTART, why=f"resumed at byte {cr.start}, not {have}")
        found, kept, step = cr.total, have, Step.APPEND
    elif status == 200:
        # No Range asked, or the server ignored it: the body is the whole file.
        found, kept, step = parse_length(content_length), 0, Step.WRITE
    else:
        return Answer(Step.OTHER)
    if expected is not None and found is not None and found != expected:
        return Answer(Step.WRONG_LENGTH, total=found, have=kept)
    return Answer(step, total=found if found is not None else expected, have=kept)


def lacking_space(directory: Path, needed: int) -> int | None:
    """The free bytes in ``directory`` when they are fewer than ``needed``; None when it fits."""
    free = shutil.disk_usage(directory).free
    return free if needed > free else None


def overruns(done: int, more: int, total: int | None) -> bool:
    """Whether ``more`` bytes after ``done`` go past the length the answer promised."""
    return total is not None and done + more > total
