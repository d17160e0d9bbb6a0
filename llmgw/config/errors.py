"""Turning validation failures into messages that name the key's full path."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from llmgw.errors import LlmgwError


class ConfigError(LlmgwError):
    """A configuration file could not be used; the message says where and why."""


def format_loc(loc: Sequence[int | str]) -> str:
    """("models", 1, "endpoints", 0, "url") -> "models[1].endpoints[0].url"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _reason(err: ErrorDetails) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown key (check its spelling and where it sits; see docs/configuration.md)"
    if kind == "missing":
        return "is required but missing"
    msg = err.get("msg", "is not valid")
    # pydantic prefixes custom errors with "Value error, "; the reason reads better without it.
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    return msg


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: the configuration is not valid:"]
    for err in exc.errors():
        loc = [p for p in err.get("loc", ()) if not (isinstance(p, str) and p.startswith("function-"))]
        # A check across several keys names its own paths in the message.
        lines.append(f"  {format_loc(loc)}: {_reason(err)}" if loc else f"  {_reason(err)}")
    return "\n".join(lines)
