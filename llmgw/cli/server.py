"""`llmgw server`."""

from __future__ import annotations

from functools import partial

import typer

from llmgw.cli.common import fail, load_config_or_fail
from llmgw.config.server import DEFAULT_CONFIG_PATH


def server(
    config: str = typer.Option(DEFAULT_CONFIG_PATH, "--config", "-c", help="Path of server.yaml."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Run the gateway: the OpenAI-compatible API on `listen`, the admin API and metrics on `admin_listen`, metrics on `metrics_listen`."""
    from llmgw.runtime import run_until_stopped, setup_logging
    from llmgw.server.app import StartError, serve_until_stopped

    cfg = load_config_or_fail(config)
    setup_logging(log_level)
    try:
        run_until_stopped(partial(serve_until_stopped, cfg))
    except StartError as exc:
        fail(str(exc))
