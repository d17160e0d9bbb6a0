"""The `llmgw` command: one executable, every role."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import import_module

import typer

from llmgw import __version__

# Each command's module is loaded only when that command runs: importing every group costs
# a second of CPU, which `llmgw agent` on a node, and each of `llmgw up`'s three processes
# starting side by side, would otherwise pay for commands they never run. Help, and a name
# that is no command, load them all. The order is the order of the help.
COMMANDS: dict[str, tuple[str, str | None]] = {  # name: (module, its function; None: the module's group `app`)
    "server": ("llmgw.cli.server", None),
    "keys": ("llmgw.cli.keys", None),
    "users": ("llmgw.cli.users", None),
    "org": ("llmgw.cli.org", None),
    "agent": ("llmgw.cli.agent", None),
    "ctl": ("llmgw.cli.ctl", None),
    "node": ("llmgw.cli.node", None),
    "mirror": ("llmgw.cli.mirror", None),
    "up": ("llmgw.cli.up", "up"),
    "doctor": ("llmgw.cli.doctor", "doctor"),
}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmgw v{__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Self-hosted LLM gateway: one OpenAI-compatible URL, with API keys, in front of your inference engines."""


def build(names: Sequence[str] = tuple(COMMANDS)) -> typer.Typer:
    """The command with ``names`` (every command by default) loaded into it."""
    cli = typer.Typer(
        name="llmgw",
        help="Self-hosted LLM gateway: one OpenAI-compatible URL, with API keys, in front of your inference engines.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    cli.callback()(_root)
    for name in names:
        module, function = COMMANDS[name]
        loaded = import_module(module)
        if function is None:
            cli.add_typer(loaded.app, name=name)
        else:
            command = getattr(loaded, function)
            cli.command(name, help=command.__doc__)(command)
    return cli


def wanted(argv: Sequence[str]) -> tuple[str, ...]:
    """The one command ``argv`` runs when its first word names one; every command otherwise."""
    first = next((word for word in argv if not word.startswith("-")), None)
    if first in COMMANDS and not any(word in ("-h", "--help") for word in argv[: argv.index(first)]):
        return (first,)
    return tuple(COMMANDS)


def __getattr__(name: str) -> typer.Typer:
    # `from llmgw.cli.main import app` (the tests' CliRunner) gets every command, built once.
    if name == "app":
        app = build()
        globals()["app"] = app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    build(wanted(sys.argv[1:]))()


if __name__ == "__main__":
    main()
