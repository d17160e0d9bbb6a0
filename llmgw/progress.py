"""What a long command tells its operator while it works: steps, progress, a secret, notes, questions.

`server init` and `node add` run their steps against a :class:`Steps`; the
plain one here prints one line per step (no terminal, ``--plain``, a log), and
the terminal screens (:mod:`llmgw.cli.screens`) draw the same calls as a live
checklist. A step's end line is the same text in both, so the screen's closing
transcript reads like the plain run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Protocol


class Status(StrEnum):
    """How a step ended; RUNNING while it has not."""

    RUNNING = "running"
    MADE = "made"  # it created what was missing
    CHANGED = "changed"  # it changed what was there
    KEPT = "kept"  # it found everything as wanted
    SKIPPED = "skipped"  # not asked for (a --no-… flag)
    WARNED = "warned"  # done, with something the operator should read
    FAILED = "failed"  # stopped here; the detail says what to do


class Steps(Protocol):
    def begin(self, key: str, title: str) -> None:
        """A step starts; ``key`` names it in the calls that follow ("1", "node b: ssh")."""

    def end(self, key: str, status: Status, detail: str) -> None:
        """The step ``key`` ended; ``detail`` is its one line for a person."""

    def progress(self, key: str, done: int, total: int | None, what: str) -> None:
        """Bytes (or items) of a step's download so far; ``total`` None when not known."""

    def secret(self, label: str, value: str) -> None:
        """A value shown once (the administrator's password): kept in view until the end."""

    def note(self, text: str) -> None:
        """A line that belongs to no step (a summary, what to do next)."""

    def ask(self, question: str, choices: Sequence[str], default: str | None) -> str | None:
        """One of ``choices``, or a name typed for a free question (``choices`` empty); None when
        nobody can be asked (plain output), so the caller takes its non-interactive path."""


Emit = Callable[[str], None]


class PlainSteps:
    """One line per ended step, progress at most every few seconds, questions never asked."""

    def __init__(self, emit: Emit = print, *, every: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.emit = emit
        self.every = every
        self.clock = clock
        self.titles: dict[str, str] = {}
        self._last: dict[str, float] = {}

    def begin(self, key: str, title: str) -> None:
        self.titles[key] = title

    def end(self, key: str, status: Status, detail: str) -> None:
        lead = f"{key}. " if key.isdigit() else f"{key}: "
        self.emit(f"{lead}{detail}" if status != Status.FAILED else f"{lead}FAILED: {detail}")

    def progress(self, key: str, done: int, total: int | None, what: str) -> None:
        now = self.clock()
        finished = total is not None and done >= total
        if not finished and now - self._last.get(key, -self.every) < self.every:
            return
        self._last[key] = now
        self.emit(f"   {what}: {format_progress(done, total)}")

    def secret(self, label: str, value: str) -> None:
        self.emit(f"   {label}: {value}")

    def note(self, text: str) -> None:
        self.emit(text)

    def ask(self, question: str, choices: Sequence[str], default: str | None) -> str | None:
        return None


def human_size(n: float) -> str:
    """Bytes for a person: 512 bytes, 3.4 MB, 12 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} bytes"


def format_progress(done: int, total: int | None) -> str:
    if total:
        return f"{human_size(done)} of {human_size(total)} ({100 * done / total:.0f}%)"
    return human_size(done)
