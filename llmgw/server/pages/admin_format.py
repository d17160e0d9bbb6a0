"""Words and numbers as the administrator's pages show them: relative times ("3 hours ago"),
binary sizes, a percent under ten with a decimal, spend in the pricing's units."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from urllib.parse import quote


def size(n: float | None) -> str:
    """Binary sizes: 512 B, 16 MiB, 1.2 GiB (one decimal under ten)."""
    if n is None:
        return "?"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 10 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def percent(p: float | None) -> str:
    """12%, 4.5% (under ten keeps a decimal)."""
    if p is None:
        return "?"
    return f"{p:.1f}%" if p < 10 else f"{p:.0f}%"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def duration(s: float | None) -> str:
    """45 seconds, 12 minutes, 5 hours, 3 days."""
    if s is None:
        return "?"
    s = max(0.0, s)
    if s < 120:
        return _plural(round(s), "second")
    if s < 2 * 3600:
        return _plural(round(s / 60), "minute")
    if s < 2 * 86400:
        return _plural(round(s / 3600), "hour")
    return _plural(round(s / 86400), "day")


def ago(when: float | datetime | None, now: float | None = None) -> str:
    """ "3 hours ago" for a wall-clock time (epoch seconds or a datetime)."""
    if when is None:
        return "never"
    ts = when.timestamp() if isinstance(when, datetime) else when
    gone = (time.time() if now is None else now) - ts
    return "just now" if gone < 2 else duration(gone) + " ago"


def clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S UTC")


def spend(micros: int) -> str:
    """Spend in the pricing's whole units (server.yaml auth.pricing), to a hundredth, or finer when small."""
    v = micros / 1_000_000
    return f"{v:,.2f}" if v >= 1 or v == 0 else f"{v:.4f}"


def money(micros: int) -> str:
    """Spend to the cent, or finer where it is under one (the Quotas, Usage, Organization and Account pages)."""
    if 0 < micros < 10_000:
        return f"{micros / 1_000_000:,.6f}".rstrip("0")
    return f"{micros / 1_000_000:,.2f}"


def count(n: float | None) -> str:
    return "?" if n is None else f"{n:,.0f}"


def node_href(node_id: str) -> str:
    """A node page's address; the id is the agent's, so it is quoted whatever it holds."""
    return "/admin/nodes/" + quote(node_id, safe="")


class Fmt:
    """The formatting helpers, handed to the templates as ``fmt`` (not global filters: other pages
    register theirs on the same environment)."""

    size = staticmethod(size)
    percent = staticmethod(percent)
    duration = staticmethod(duration)
    ago = staticmethod(ago)
    clock = staticmethod(clock)
    spend = staticmethod(spend)
    count = staticmethod(count)
    node_href = staticmethod(node_href)


FMT = Fmt()
