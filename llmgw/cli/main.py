"""The `llmgw` command: one executable, every role."""

from __future__ import annotations

import typer

from llmgw import __version__
from llmgw.cli import agent, ctl, doctor, keys, mirror, node, org, server, up, users

app = typer.Typer(
    name="llmgw",
    help="Self-hosted LLM gateway: one OpenAI-compatible URL, with API keys, in front of your inference engines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmgw v{__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Self-hosted LLM gateway: one OpenAI-compatible URL, with API keys, in front of your inference engines."""


app.add_typer(server.app, name="server")
app.add_typer(keys.app, name="keys")
app.add_typer(users.app, name="users")
app.add_typer(org.app, name="org")
app.add_typer(agent.app, name="agent")
app.add_typer(ctl.app, name="ctl")
app.add_typer(node.app, name="node")
app.add_typer(mirror.app, name="mirror")
app.command("up", help=up.up.__doc__)(up.up)
app.command("doctor", help=doctor.doctor.__doc__)(doctor.doctor)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
