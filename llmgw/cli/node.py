"""`llmgw node`: the nodes of the fleet."""

from __future__ import annotations

import typer

from llmgw.cli.admin_client import ServerOpt, TokenFileOpt, connect
from llmgw.cli.ctl import call
from llmgw.protocol.admin import Removed

app = typer.Typer(help="The fleet's nodes.", no_args_is_help=True)


@app.command("remove")
def remove(
    name: str = typer.Argument(..., help="The node's id."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Forget a node gone for good: a lost one (silent for control.lost_after), or an unreachable one with
    nothing placed on it. Anything else is refused with its state: drain it and stop its agent, or wait
    until it is lost."""
    got = call("DELETE", connect(server, token_file), f"/api/v1/nodes/{name}", Removed)
    typer.echo(f"removed {got.removed}")
