"""`llmgw ctl fabric-test A B`: what one rail measured, how it is graded, and
the table the CLI prints.

A rail is one of A's adapters on the shared fabric paired with B's
same-named one. Each is graded against its link rate (the slower end's, as
the control plane reads it from the inventory): **ok** at 80 % or more,
**slow** at 50 % or more, **fail** below that or when nothing got through.
The command exits non-zero unless every rail is ok.

Rates are Gbit/s (10^9 bits per second), the unit ports and perftest's
``--report_gbits`` use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from enum import StrEnum

from llmgw.errors import LlmgwError

from .base import WireModel

# The thresholds, in percent of the link rate.
OK_PERCENT = 80
SLOW_PERCENT = 50


class FabricTestError(LlmgwError):
    """A rail could not be graded or shown: a link rate that is not a rate."""


class Grade(StrEnum):
    """The verdict on one rail (compares equal to its string)."""

    OK = "ok"
    SLOW = "slow"
    FAIL = "fail"


class RailResult(WireModel):
    """One rail: A's adapter to B's, its link rate and what went through it."""

    adapter: str  # A's adapter, e.g. mlx5_0
    peer_adapter: str  # B's, the same name on a rail-aligned cluster
    link_rate_gbps: float | None = None  # None: the rate is not known (LINK shows "-")
    measured_gbps: float | None = None  # None: nothing got through
    grade: Grade
    # Why, in words, when the figure alone does not say: the failure
    # ("the peer's ib_write_bw server was not listening at …"), or a note.
    detail: str | None = None


def grade(measured_gbps: float | None, link_rate_gbps: float) -> Grade:
    """ok at 80 % of the link rate or more, slow at 50 % or more, fail below or when nothing got through."""
    if not (math.isfinite(link_rate_gbps) and link_rate_gbps > 0):
        raise FabricTestError(f"a link rate must be a positive number of Gb/s, not {link_rate_gbps!r}")
    if measured_gbps is None or not math.isfinite(measured_gbps) or measured_gbps <= 0:
        return Grade.FAIL
    # Compared multiplied out, so 320 of 400 is exactly 80 % and not 79.999…
    if measured_gbps * 100 >= link_rate_gbps * OK_PERCENT:
        return Grade.OK
    if measured_gbps * 100 >= link_rate_gbps * SLOW_PERCENT:
        return Grade.SLOW
    return Grade.FAIL


def exit_code(results: Sequence[RailResult]) -> int:
    """0 only when every rail is ok; a test of no rails showed nothing to work, so it is 1 too."""
    return 0 if results and all(r.grade == Grade.OK for r in results) else 1


def percent_of_link(measured_gbps: float, link_rate_gbps: float) -> int:
    """Whole percent, rounded down, so 79.9 % reads 79 % beside a "slow", never 80 %."""
    return math.floor(measured_gbps * 100 / link_rate_gbps + 1e-9)


def _rate(gbps: float) -> str:
    """A link rate as ports state it: 400, 200, 2.5."""
    return f"{gbps:g}"


def _rail_name(r: RailResult) -> str:
    return r.adapter if r.adapter == r.peer_adapter else f"{r.adapter} → {r.peer_adapter}"


def _detail(r: RailResult) -> str:
    parts: list[str] = []
    if r.measured_gbps is not None and r.link_rate_gbps:
        parts.append(f"{percent_of_link(r.measured_gbps, r.link_rate_gbps)}% of {_rate(r.link_rate_gbps)} Gb/s")
    elif r.measured_gbps is None and not r.detail:
        parts.append("nothing got through")
    if r.detail:
        parts.append(r.detail)
    return "; ".join(parts)


def _row(r: RailResult) -> list[str]:
    return [
        f"{r.adapter} → {r.peer_adapter}",
        f"{_rate(r.link_rate_gbps)} Gb/s" if r.link_rate_gbps else "-",
        f"{r.measured_gbps:.1f} Gb/s" if r.measured_gbps is not None else "-",
        str(r.grade),
        _detail(r),
    ]


def summary(results: Sequence[RailResult]) -> str:
    """One line: how many passed, then each rail that did not and why."""
    if not results:
        return "no rails were tested"
    passed = sum(1 for r in results if r.grade == Grade.OK)
    line = f"{passed} of {len(results)} rails passed"
    problems = []
    for r in results:
        if r.grade == Grade.OK:
            continue
        verb = "is slow" if r.grade == Grade.SLOW else "failed"
        if r.measured_gbps is None:
            why = r.detail or "nothing got through"
        elif r.link_rate_gbps:
            why = f"{r.measured_gbps:.0f} Gb/s of {_rate(r.link_rate_gbps)}"
        else:
            why = f"{r.measured_gbps:.0f} Gb/s"
        problems.append(f"{_rail_name(r)} {verb}: {why}")
    return "; ".join([line, *problems])


def _took(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def render_table(
    node_a: str,
    node_b: str,
    fabric: str,
    results: Sequence[RailResult],
    *,
    took_s: float | None = None,
    notes: Iterable[str] = (),
) -> str:
    """What `ctl fabric-test` prints: a heading line, the rails, ``note:`` lines, the summary.

    The columns are the CLI spec's (RAIL LINK MEASURED VERDICT DETAIL); the
    percentage of the link rate is in DETAIL, beside any reason.
    """
    head = f"{node_a} → {node_b} on {fabric}" + (f", {_took(took_s)}" if took_s is not None else "")
    rows = [["RAIL", "LINK", "MEASURED", "VERDICT", "DETAIL"]]
    rows.extend(_row(r) for r in results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    lines.extend(f"note: {n}" for n in notes)
    lines.append("")
    lines.append(summary(results))
    return "\n".join(lines) + "\n"
