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
    """Forget a lost node (one that has not reported for control.lost_after); a node in any other state is refused."""
    got = call("DELETE", connect(server, token_file), f"/api/v1/nodes/{name}", Removed)
    typer.echo(f"removed {got.removed}")
