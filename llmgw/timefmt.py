"""How long something took or has been, at a person's precision, in the short
form tables use: 45s, 12m, 5h, 3d. The CLI and the control plane both print it."""

from __future__ import annotations


def short_duration(s: float | None) -> str:
    """45s, 12m, 5h, 3d; "-" when not known."""
    if s is None:
        return "-"
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f}s"
    if s < 2 * 3600:
        return f"{s / 60:.0f}m"
    if s < 2 * 86400:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"
