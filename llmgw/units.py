"""systemd unit files: the one writer every role's unit goes through (server, mirror, agent).

A unit is rendered from its parts so that each role says only what differs
(who it runs as, what it may write, how it stops), and written only when its
text changed, so a rerun of an init command leaves the file and its mtime alone.
"""

from __future__ import annotations

from pathlib import Path

from llmgw.files import write_atomic

UNITS_DIR = "/etc/systemd/system"


def quote(arg: str) -> str:
    """One word of an ExecStart= line, quoted the way systemd reads it."""
    if arg and not any(c in arg for c in " \t\"'\\$%;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$") + '"'


def unit_text(*, description: str, exec_start: list[list[str]], service: list[str]) -> str:
    """A unit started after the network is up, wanted by multi-user.target.

    ``exec_start`` is the command in groups, one group a line (continued with a
    backslash); ``service`` the other lines of [Service], in order.
    """
    command = " \\\n  ".join(" ".join(quote(a) for a in group) for group in exec_start)
    body = "\n".join(service)
    return f"""[Unit]
Description={description}
After=network-online.target
Wants=network-online.target

[Service]
ExecStart={command}
{body}

[Install]
WantedBy=multi-user.target
"""


def write_unit(path: str | Path, text: str) -> str | None:
    """Write the unit when its text differs; returns "wrote" (new), "updated", or None (already so)."""
    p = Path(path)
    old = p.read_text(encoding="utf-8") if p.exists() else None
    if old == text:
        return None
    write_atomic(p, text.encode("utf-8"), 0o644)
    return "wrote" if old is None else "updated"
