"""Waiting on conditions, for tests and benchmarks: the one ``until`` (and ``async_until``).

A fixed sleep is a guess at how long something takes; on a loaded two-core machine the guess is
wrong and the test flakes. These poll a condition instead and, when it does not come, fail with
what was awaited, the last value or error seen, and (end-to-end) the tail of each process's log.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterable
from typing import Any

# How much of each process log a failure prints: enough for a traceback, not a whole run.
LOG_TAIL = 2500


def _exited(procs: Iterable[Any]) -> Any:
    """The first process that has exited, if any: a harness Proc (``alive()``), a Popen (``poll()``)
    or an asyncio subprocess (``returncode``)."""
    for p in procs:
        if hasattr(p, "alive"):
            gone = not p.alive()
        elif hasattr(p, "poll"):
            gone = p.poll() is not None
        else:
            gone = p.returncode is not None
        if gone:
            return p
    return None


def _logs(procs: Iterable[Any]) -> str:
    out = []
    for p in procs:
        try:
            text = p.text()
        except Exception as exc:  # a log that cannot be read must not hide the failure itself
            text = f"(log unreadable: {exc!r})"
        out.append(f"--- {getattr(p, 'log', p)}\n{text[-LOG_TAIL:]}")
    return "\n\n".join(out)


class _Wait:
    """The state and the failure message shared by the sync and async forms."""

    def __init__(self, timeout: float, what: str, procs, detail, alive, ignore) -> None:
        self.timeout, self.what, self.detail = timeout, what, detail
        self.alive = list(alive)
        # Processes whose logs a failure shows: those named, and those that must stay alive.
        self.procs = list(procs) + [p for p in self.alive if p not in procs and hasattr(p, "text")]
        self.ignore = tuple(ignore)
        self.deadline = time.monotonic() + timeout
        self.last: Any = None
        self.error: BaseException | None = None

    def check(self) -> None:
        """Fail now if a process that must stay alive exited, or the time is up."""
        gone = _exited(self.alive)
        if gone is not None:
            name = getattr(gone, "log", None) or getattr(gone, "args", None) or gone
            raise AssertionError(self._message(f"{name} exited while waiting for {self.what}"))
        if time.monotonic() > self.deadline:
            raise AssertionError(self._message(f"timed out after {self.timeout}s waiting for {self.what}"))

    def _message(self, head: str) -> str:
        parts = [head]
        if self.error is not None:
            parts.append(f"last error: {self.error!r}")
        else:
            parts.append(f"last value: {self.last!r}"[:500])
        if self.detail is not None:
            try:
                parts.append(str(self.detail()))
            except Exception as exc:
                parts.append(f"(detail failed: {exc!r})")
        msg = "; ".join(parts)
        if self.procs:
            msg += "\n" + _logs(self.procs)
        return msg


def until(
    cond: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "the condition",
    procs: Iterable[Any] = (),
    detail: Callable[[], Any] | None = None,
    *,
    alive: Iterable[Any] = (),
    ignore: tuple[type[BaseException], ...] = (),
    interval: float = 0.05,
) -> Any:
    """Call ``cond`` until it returns something true, and return that.

    ``what`` names what is awaited in the failure; ``procs`` are processes (``.log``, ``.text()``) whose log
    tails the failure shows; ``detail()`` adds state at the time of failure; ``alive`` are processes whose exit
    fails the wait at once; exceptions in ``ignore`` (an engine not up yet) count as "not yet".
    """
    w = _Wait(timeout, what, list(procs), detail, alive, ignore)
    while True:
        try:
            w.last, w.error = cond(), None
        except w.ignore as exc:
            w.last, w.error = None, exc
        if w.last:
            return w.last
        w.check()
        time.sleep(interval)


# A timeout parameter, not asyncio.timeout: the same call as until(), and a failure that says what it awaited.
async def async_until(
    cond: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "the condition",
    procs: Iterable[Any] = (),
    detail: Callable[[], Any] | None = None,
    *,
    alive: Iterable[Any] = (),
    ignore: tuple[type[BaseException], ...] = (),
    interval: float = 0.01,
) -> Any:
    """``until`` for a running event loop: polls without blocking it; ``cond`` may be a coroutine function."""
    w = _Wait(timeout, what, list(procs), detail, alive, ignore)
    while True:
        try:
            got = cond()
            if inspect.isawaitable(got):
                got = await got
            w.last, w.error = got, None
        except w.ignore as exc:
            w.last, w.error = None, exc
        if w.last:
            return w.last
        w.check()
        await asyncio.sleep(interval)
