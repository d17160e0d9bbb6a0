"""Where an engine's installation stands, in words a person can read.

Every change is reported as it happens, download progress included: an
install takes minutes, and one that is silent for minutes looks stuck.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from llmgw.errors import LlmgwError
from llmgw.protocol import ProvisionState


@dataclass(frozen=True)
class InstallRecord:
    """An engine's installation as this node records it: what ``to_wire`` sends as a
    ``llmgw.protocol.ProvisionStatus``, plus the binary's path, which stays here."""

    engine: str
    version: str
    state: ProvisionState
    # What is happening or what went wrong, for a person.
    detail: str = ""
    variant: str = ""
    # The executable once ready (absolute path).
    binary: str = ""
    # Download progress while installing; total is None when the server did
    # not say how long the file is (no percentage is invented then).
    bytes_done: int | None = None
    bytes_total: int | None = None
    # Failed: wall clock (epoch seconds) of the next attempt, once one is scheduled.
    retry_at: float | None = None

    def to_wire(self) -> dict:
        """The fields of ``llmgw.protocol.ProvisionStatus``; absent means unknown.

        ``binary`` stays on the node: the control plane has no use for a path.
        """
        d: dict = {"engine": self.engine, "state": self.state.value}
        for k in ("version", "variant", "detail"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if self.bytes_done is not None:
            d["progress"] = {"bytes_done": self.bytes_done}
            if self.bytes_total is not None:
                d["progress"]["bytes_total"] = self.bytes_total
        if self.retry_at is not None:
            d["retry_at"] = self.retry_at
        return d


OnStatus = Callable[[InstallRecord], None]


class ProvisionError(LlmgwError, RuntimeError):
    """An install failed; the message says what went wrong and what to do."""


class Unsupported(ProvisionError):
    """No build fits this machine (old driver, unknown architecture, unknown engine)."""


class NotHere(ProvisionError):
    """The engine is not meant for this node; reported as skipped, not as a fault."""


class Unreachable(ProvisionError):
    """The release server could not be reached at all (as opposed to refusing)."""


class Reporter:
    """Sends one engine's status to ``on_status`` each time it changes.

    Download progress is rate-limited (``min_interval`` seconds) so a fast
    local download does not flood the stream; a change of words, the first
    and the last progress update always go out.
    """

    def __init__(
        self,
        status: InstallRecord,
        on_status: OnStatus | None,
        *,
        min_interval: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        already_sent: InstallRecord | None = None,
    ) -> None:
        # already_sent: what the listener last heard for this engine, so a
        # recheck that changes nothing says nothing.
        self.status = status
        self._on_status = on_status
        self._min_interval = min_interval
        self._clock = clock
        self._last_sent: InstallRecord | None = already_sent
        self._last_at = float("-inf")

    def update(self, **changes) -> InstallRecord:
        """Change fields and report; progress and the retry time are cleared unless given
        (an attempt under way is not one still to come)."""
        changes.setdefault("bytes_done", None)
        changes.setdefault("bytes_total", None)
        changes.setdefault("retry_at", None)
        self.status = replace(self.status, **changes)
        self._send(force=True)
        return self.status

    def installing(self, detail: str) -> None:
        self.update(state=ProvisionState.INSTALLING, detail=detail)

    def progress(self, done: int, total: int | None) -> None:
        self.status = replace(self.status, bytes_done=done, bytes_total=total)
        first = self._last_sent is None or self._last_sent.bytes_done is None
        last = total is not None and done >= total
        self._send(force=first or last)

    def _send(self, force: bool) -> None:
        if self._on_status is None or self.status == self._last_sent:
            return
        now = self._clock()
        if not force and now - self._last_at < self._min_interval:
            return
        self._last_sent, self._last_at = self.status, now
        self._on_status(self.status)
