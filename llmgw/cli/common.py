"""What several commands share: printing errors, finding server.yaml and the store."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

from llmgw.config import ConfigError, ServerConfig, load_server_config
from llmgw.config.server import DEFAULT_CONFIG_PATH, DEFAULT_STORE

err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", markup=True) if sys.stderr.isatty() else print(
        f"error: {message}", file=sys.stderr
    )
    raise typer.Exit(code)


def load_config_or_fail(path: str) -> ServerConfig:
    try:
        return load_server_config(path)
    except ConfigError as exc:
        fail(str(exc))


def resolve_store(store: str | None, config: str | None) -> tuple[str, str]:
    """The store address and which of flag, server.yaml or default chose it."""
    if store:
        return store, "--store"
    path = config or (DEFAULT_CONFIG_PATH if Path(DEFAULT_CONFIG_PATH).exists() else None)
    if path:
        cfg = load_config_or_fail(path)
        return cfg.auth.store, f"auth.store in {path}"
    return DEFAULT_STORE, "the single-machine default"


def print_table(columns: tuple[str, ...] | list[str], rows) -> None:
    """A plain table as every listing prints it: bold headers, no borders, no wrapping."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in columns:
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(*r)
    Console(highlight=False, width=200).print(table)


def when(t: datetime | None) -> str:
    """A timestamp in listings, to the minute; "-" for never."""
    return f"{t:%Y-%m-%d %H:%M}" if t else "-"
