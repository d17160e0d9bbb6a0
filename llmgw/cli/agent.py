"""`llmgw agent`: the node agent, and the checks an operator runs on a node."""

from __future__ import annotations

import json
from functools import partial

import typer

from llmgw.cli.common import err, fail
from llmgw.config.agent import DEFAULT_AGENT_CONFIG_PATH

app = typer.Typer(
    help="The node agent: run it, see what it finds on this machine, check an engine binary.",
    invoke_without_command=True,
)


@app.callback()
def agent(
    ctx: typer.Context,
    config: str = typer.Option(DEFAULT_AGENT_CONFIG_PATH, "--config", "-c", help="Path of agent.yaml."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Run the node agent: it dials the control plane, reports this machine, installs and supervises engines.

    Engines keep running when the agent stops; a restarted agent adopts them.
    """
    if ctx.invoked_subcommand is not None:
        return
    from llmgw.agent.client import LinkError
    from llmgw.agent.service import serve_until_stopped
    from llmgw.runtime import run_until_stopped, setup_logging

    cfg = _load(config)
    setup_logging(log_level)
    try:
        run_until_stopped(partial(serve_until_stopped, cfg))
    except LinkError as exc:
        fail(str(exc))


def _load(path: str):
    from llmgw.config import ConfigError
    from llmgw.config.agent import load_agent_config

    try:
        return load_agent_config(path)
    except ConfigError as exc:
        fail(str(exc))


@app.command("inventory")
def inventory(
    as_json: bool = typer.Option(False, "--json", help="Print what the control plane would receive, as JSON."),
    config: str = typer.Option(
        None, "--config", "-c", help="agent.yaml whose discovery settings and model_dirs to use."
    ),
) -> None:
    """Print what this machine is, as the control plane would see it: host, memory, disks, GPUs, NVLink, adapters."""
    from pathlib import Path

    from llmgw.agent.discovery.collect import DiscoveryOptions, collect_inventory
    from llmgw.agent.discovery.report import render_inventory

    opts = DiscoveryOptions()
    if config:
        cfg = _load(config)
        opts = DiscoveryOptions(
            model_dirs=(*cfg.model_dirs, cfg.weights_cache),
            nvidia_smi=cfg.discovery.nvidia_smi,
            ib_root=Path(cfg.discovery.ib_root),
            prefer_nvml=cfg.discovery.prefer_nvml,
            skip_gpus=cfg.discovery.skip_gpus,
        )
    typer.echo(render_inventory(collect_inventory(opts), as_json))


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
            typer.echo(
                f"{report.engine}: all {len(report.flags)} flags llmgw passes are in {report.bin}'s help "
                f"({report.help_lines} lines)"
            )
    if not report.ok:
        raise typer.Exit(1)
