"""`llmgw keys`: API keys, worked on in the store directly.

Working on the store (not through a running server) means keys can be issued
before the server runs, without an endpoint that mints credentials.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import TypeVar

import typer
from rich.console import Console
from rich.table import Table

from llmgw.cli.common import err, fail, resolve_store
from llmgw.store import Store, StoreError

T = TypeVar("T")

app = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)

_STORE_HELP = "Store address (path, postgres:// URL or @file); default: auth.store of --config, else /var/lib/llmgw/llmgw.db."
_CONFIG_HELP = "server.yaml whose auth.store to use (default /etc/llmgw/server.yaml when it exists)."


def _with_store(store: str | None, config: str | None, op: Callable[[Store], Awaitable[T]]) -> T:
    """Open the store (saying which setting chose it when that fails), run op, close."""
    address, chosen_by = resolve_store(store, config)

    async def run() -> T:
        try:
            s = await Store.open(address)
        except Exception as exc:
            fail(f"cannot open the store chosen by {chosen_by}: {exc}")
        try:
            return await op(s)
        except (StoreError, LookupError, ValueError) as exc:
            fail(str(exc))
        finally:
            await s.close()

    return asyncio.run(run())


def _parse_lifetime(text: str) -> timedelta | None:
    if text.strip() in ("", "0"):
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(h|d|w)\s*", text)
    if not m:
        fail(f'--expires-in "{text}" is not a lifetime; write it like 12h, 30d or 8w (0 never expires)')
    n, unit = int(m.group(1)), m.group(2)
    return timedelta(hours=n) if unit == "h" else timedelta(days=n * (7 if unit == "w" else 1))


@app.command("create")
def create(
    name: str = typer.Option(..., "--name", "-n", help="What the key is for, e.g. 'ci-bot' or 'alice laptop'."),
    project: str = typer.Option(None, "--project", help="Project the key's usage is counted under."),
    expires_in: str = typer.Option("0", "--expires-in", help="Lifetime such as 12h, 30d, 8w; 0 never expires."),
    store: str = typer.Option(None, "--store", help=_STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=_CONFIG_HELP),
) -> None:
    """Create an API key. The secret is printed once, alone on the last line of standard output; only its hash is kept."""
    lifetime = _parse_lifetime(expires_in)
    expires = datetime.now(timezone.utc) + lifetime if lifetime else None
    secret, rec = _with_store(store, config, lambda s: s.create_key(name, project=project, expires_at=expires))
    err.print(f"created key {rec.id} ({rec.name}); it is shown once, keep it now", highlight=False)
    if rec.expires_at:
        err.print(f"expires {rec.expires_at:%Y-%m-%d %H:%M} UTC", highlight=False)
    typer.echo(secret)


def _when(dt: datetime | None) -> str:
    return f"{dt:%Y-%m-%d %H:%M}" if dt else "-"


@app.command("list")
def list_(
    all_: bool = typer.Option(False, "--all", "-a", help="Include revoked and expired keys."),
    store: str = typer.Option(None, "--store", help=_STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=_CONFIG_HELP),
) -> None:
    """List API keys: id, name, visible prefix, project, state, when created and last used. Secrets are never shown."""
    keys = _with_store(store, config, lambda s: s.list_keys(include_revoked=True))
    now = datetime.now(timezone.utc)
    rows = []
    for k in keys:
        state = "revoked" if k.revoked_at else ("expired" if k.expires_at and k.expires_at <= now else "active")
        if state != "active" and not all_:
            continue
        rows.append((k.id, k.name, k.prefix + "…", k.project or "-", state, _when(k.created_at), _when(k.last_used_at)))
    if not rows:
        err.print("no keys" + ("" if all_ else " (revoked and expired keys are listed with --all)"), highlight=False)
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("ID", "NAME", "KEY", "PROJECT", "STATE", "CREATED", "LAST USED"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(*r)
    Console(highlight=False, width=200).print(table)


@app.command("revoke")
def revoke(
    key: str = typer.Argument(..., metavar="ID|PREFIX", help="The key's id (key-…) or its visible prefix (llmgw-…)."),
    store: str = typer.Option(None, "--store", help=_STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=_CONFIG_HELP),
) -> None:
    """Revoke an API key. A running server refuses it within two seconds."""
    rec = _with_store(store, config, lambda s: s.revoke_key(key))
    err.print(f"revoked key {rec.id} ({rec.name}, {rec.prefix}…)", highlight=False)
