"""The usage journal: rows the store could not take at shutdown, kept on local disk
until the next start writes them to the store.

One JSON object a line, appended and fsynced. A line cut short by a crash in the
middle of an append is skipped when read (and said so); every other line is read
back as the row it was. Rows carry their request_id, and the store skips ids it
already holds, so reading the same journal into the store twice stores each row once.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path

import orjson

from llmgw.files import fsync_dir
from llmgw.store import UsageRow

JOURNAL_NAME = "usage-journal"


def _types() -> dict[str, tuple[type, ...]]:
    # Checked on read, so a damaged line is skipped there rather than failing every later
    # start at the store. A float field may hold an int (UsageRow(latency_ms=1)).
    out = {}
    for name, hint in typing.get_type_hints(UsageRow).items():
        allowed = typing.get_args(hint) or (hint,)
        out[name] = allowed + (int,) if float in allowed else allowed
    return out


_TYPES = _types()
_FIELDS = tuple(f.name for f in fields(UsageRow) if f.name not in ("id", "at"))
# Without its request_id a second replay could store a row twice.
_REQUIRED = ("model", "endpoint", "status", "latency_ms", "at", "request_id")


@dataclass(frozen=True, slots=True)
class TornLine:
    """A line that is not a whole row: where it is and what it held (cut short)."""

    number: int
    reason: str
    start: bytes


class UsageJournal:
    """The journal file at ``path``; one server writes it (its data_dir is its own)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def exists(self) -> bool:
        return self.path.exists()

    def append(self, rows: Sequence[UsageRow]) -> None:
        """Append ``rows`` and fsync them; raises OSError when the disk will not take them."""
        if not rows:
            return
        data = b"".join(_encode(r) for r in rows)
        self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        created = not self.path.exists()
        # 0600: the rows name keys, people and projects.
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            if not created and _ends_torn(fd):
                # A crash cut the last line short: end it, so the first new row is not
                # glued to it and lost with it.
                data = b"\n" + data
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            fsync_dir(self.path.parent)  # the new name must survive a power cut too

    def read(self) -> tuple[list[UsageRow], list[TornLine]]:
        """Every whole row, in the order written, and the lines that were not; raises OSError
        when the file cannot be read. A missing file is an empty journal."""
        rows: list[UsageRow] = []
        torn: list[TornLine] = []
        try:
            with open(self.path, "rb") as f:
                for number, line in _lines(f):
                    try:
                        rows.append(_decode(line))
                    except ValueError as exc:
                        torn.append(TornLine(number, str(exc), line[:120]))
        except FileNotFoundError:
            pass
        return rows, torn

    def remove(self) -> None:
        """Called once every row in it is in the store; a crash before this only means the
        next start writes them again, and the store skips what it already holds."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.path.parent)


def _encode(row: UsageRow) -> bytes:
    d = {name: getattr(row, name) for name in _FIELDS}
    d["at"] = row.at.isoformat()
    return orjson.dumps(d) + b"\n"


def _decode(line: bytes) -> UsageRow:
    if not line.endswith(b"\n"):
        raise ValueError("the line has no end (the write was cut short)")
    try:
        d = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    values = {k: d[k] for k in _FIELDS if k in d}
    wrong = [k for k, v in values.items() if type(v) not in _TYPES[k]]
    if wrong:
        raise ValueError(f"wrong type of {', '.join(wrong)}")
    try:
        at = datetime.fromisoformat(d["at"])
    except (TypeError, ValueError):
        raise ValueError(f"not a time: {d['at']!r}") from None
    if at.tzinfo is None:
        raise ValueError("a time without its zone")
    return UsageRow(**values, at=at)


def _lines(f) -> Iterator[tuple[int, bytes]]:
    for number, line in enumerate(f, start=1):
        if line.strip(b"\x00 \t\r\n"):  # a crash can leave zeroed blocks at the end of a file
            yield number, line


def _ends_torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"
