"""`llmgw ctl token`: the admin API's credentials, worked on in the store directly.

Directly, like `llmgw keys`: whoever can open the store can already do anything,
and it is how an operator who lost every token gets a new one.
"""

from __future__ import annotations

import json

import typer

from llmgw.cli.admin_client import JsonOpt
from llmgw.cli.common import err, print_table, when
from llmgw.cli.keys import CONFIG_HELP, STORE_HELP, with_store

app = typer.Typer(
    help="Admin tokens: the credential of the admin API (llmgw ctl and other admin clients).", no_args_is_help=True
)


@app.command("create")
def create(
    name: str = typer.Argument(..., help="What the token is for, e.g. alice-laptop or ci-deploy."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Make an admin token. The secret is printed once, alone on the last line of stdout."""
    secret, rec = with_store(store, config, lambda s: s.create_admin_token(name))
    err.print(
        f"created admin token {rec.id} ({rec.name}, {rec.prefix}…); it is shown once, keep it in a file "
        "only you can read and pass it with --token-file or LLMGW_ADMIN_TOKEN",
        highlight=False,
    )
    typer.echo(secret)


@app.command("list")
def list_(
    all_: bool = typer.Option(False, "--all", "-a", help="Include revoked tokens."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: JsonOpt = False,
) -> None:
    """List admin tokens: id, name, visible prefix, state, created and last used. Secrets are never shown."""
    tokens = with_store(store, config, lambda s: s.list_admin_tokens(include_revoked=all_))
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {
                        "id": t.id,
                        "name": t.name,
                        "prefix": t.prefix,
                        "state": "revoked" if t.revoked_at else "active",
                        "created_at": t.created_at.isoformat(),
                        "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None,
                        "last_used_at": t.last_used_at.isoformat() if t.last_used_at else None,
                    }
                    for t in tokens
                ],
                indent=2,
            )
        )
        return
    if not tokens:
        err.print("no admin tokens" + ("" if all_ else " (revoked ones are listed with --all)"), highlight=False)
        return
    print_table(
        ("ID", "NAME", "TOKEN", "STATE", "CREATED", "LAST USED"),
        [
            (
                t.id,
                t.name,
                t.prefix + "…",
                "revoked" if t.revoked_at else "active",
                when(t.created_at),
                when(t.last_used_at),
            )
            for t in tokens
        ],
    )


@app.command("revoke")
def revoke(
    token: str = typer.Argument(..., metavar="ID|PREFIX", help="The token's id (adm-…) or the start of its prefix."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Revoke an admin token; the admin API refuses it from the next request on."""
    rec = with_store(store, config, lambda s: s.revoke_admin_token(token))
    err.print(f"revoked admin token {rec.id} ({rec.name}, {rec.prefix}…)", highlight=False)
