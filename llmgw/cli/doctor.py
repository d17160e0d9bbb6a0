"""`llmgw doctor`: check this node for what llmgw needs, each problem with its fix."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from llmgw.cli.common import err, fail
from llmgw.config.agent import DEFAULT_AGENT_CONFIG_PATH


def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print every finding and every fact read, as JSON."),
    config: str = typer.Option(
        None, "--config", "-c", help=f"agent configuration (default {DEFAULT_AGENT_CONFIG_PATH} when present)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print the raw `nvidia-smi topo -m`."),
    ib_root: str = typer.Option(
        None, "--ib-root", help="Where RDMA adapters are listed (default /sys/class/infiniband)."
    ),
    nvidia_smi: str = typer.Option(None, "--nvidia-smi", help="Path of nvidia-smi (default: found on PATH)."),
    vllm: str = typer.Option(None, "--vllm", help="vLLM version to check installability for (default 0.30.0)."),
) -> None:
    """Check this node's CPU, memory, disk, engines, GPUs, NVLink, InfiniBand and control plane for what llmgw needs.

    Exits 1 when anything FAILs, with or without --json.
    """
    from llmgw.doctor import DoctorOptions, collect_facts, counts, evaluate, render_json, render_text
    from llmgw.doctor.facts import DEFAULT_VLLM

    cfg = None
    path = config
    if path is None and os.path.exists(DEFAULT_AGENT_CONFIG_PATH):
        path = DEFAULT_AGENT_CONFIG_PATH
    if path is not None:
        if not os.path.exists(path):
            fail(f"{path} does not exist; name an agent.yaml that does, or leave --config out")
        cfg = _load(path)
    if ib_root is not None and not Path(ib_root).is_dir():
        fail(f"--ib-root {ib_root} is not a directory; adapters are listed in /sys/class/infiniband")
    if nvidia_smi is not None and not Path(nvidia_smi).is_file():
        fail(
            f"--nvidia-smi {nvidia_smi} is not a file; give the path of nvidia-smi, or leave it out to find it on PATH"
        )
    opts = DoctorOptions(
        config=cfg,
        config_path=path,
        vllm_version=vllm or DEFAULT_VLLM,
        nvidia_smi=nvidia_smi,
        ib_root=Path(ib_root) if ib_root else None,
        nvml="auto",
    )
    facts = collect_facts(opts)
    findings = evaluate(facts)
    typer.echo(render_json(findings, facts) if as_json else render_text(findings, facts, verbose=verbose), nl=False)
    failed, _ = counts(findings)
    if failed:
        # Said on stderr so the JSON on stdout stays one document.
        err.print(f"{failed} problem(s) need fixing")
        raise typer.Exit(1)


def _load(path: str):
    from llmgw.config import ConfigError
    from llmgw.config.agent import load_agent_config

    try:
        return load_agent_config(path)
    except ConfigError as exc:
        fail(str(exc))
