"""`llmgw agent`: the node agent, and the checks an operator runs on a node."""

from __future__ import annotations

import json

import typer

from llmgw.cli.common import err, fail

app = typer.Typer(help="The node agent: run it, see what it finds on this machine, check an engine binary.",
                  no_args_is_help=True)


@app.command("engine-check")
def engine_check(
    engine: str = typer.Argument(..., help="llamacpp, vllm or sglang."),
    bin_path: str = typer.Option(..., "--bin", help="The engine's executable (for sglang, its environment's python)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check that the engine accepts every flag llmgw would pass it, by reading its --help on a word boundary."""
    from llmgw.agent.engines import UnknownEngine
    from llmgw.agent.engines.check import run_engine_check

    try:
        report = run_engine_check(engine, bin_path)
    except UnknownEngine as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for p in report.problems:
            err.print(f"problem: {p}", highlight=False)
        for w in report.warnings:
            err.print(f"warning: {w}", highlight=False)
        if report.ok:
            typer.echo(f"{report.engine}: all {len(report.flags)} flags llmgw passes are in {report.bin}'s help "
                       f"({report.help_lines} lines)")
    if not report.ok:
        raise typer.Exit(1)
