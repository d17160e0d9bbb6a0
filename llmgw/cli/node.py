"""`llmgw node`: the nodes of the fleet."""

from __future__ import annotations

import typer

from llmgw.cli.ctl import ADMIN_HELP, admin_call

app = typer.Typer(help="The fleet's nodes.", no_args_is_help=True)


@app.command("remove")
def remove(
    name: str = typer.Argument(..., help="The node's id."),
    admin: str = typer.Option("http://127.0.0.1:9090", "--admin", help=ADMIN_HELP),
) -> None:
    """Forget a lost node (one that has not reported for control.lost_after); a node in any other state is refused."""
    admin_call("DELETE", admin, f"/api/v1/nodes/{name}")
    typer.echo(f"removed {name}")
