"""`llmgw ctl mirror`: ask the fleet's mirror to fetch weights, watch it, and serve what it holds.

Everything goes through the control plane's admin API, which holds the mirror's
address and certificate (server.yaml `mirror:`).
"""

from __future__ import annotations

import json
import time
from urllib.parse import quote

import typer
from pydantic import ValidationError

from llmgw.cli.admin_client import ServerOpt, TokenFileOpt, connect
from llmgw.cli.common import fail
from llmgw.cli.ctl import _duration, _print_rows, _size, call, first_error
from llmgw.protocol.admin import CatalogProfile, MirrorServeRequest, ModelReply, Removed
from llmgw.protocol.mirror_api import MirrorFetchRequest, MirrorListing, MirrorVersion

# Annotated: llmgw.cli.ctl imports this module at its end, a cycle mypy cannot infer through.
app: typer.Typer = typer.Typer(
    help="The model mirror, through the control plane: fetch, watch, serve, remove.", no_args_is_help=True
)


def _path(model: str, version: str) -> str:
    return f"/api/v1/mirror/{quote(model, safe='')}/{quote(version, safe='')}"


def _progress(v: MirrorVersion) -> str:
    files = v.files or []
    done = sum(f.bytes_done or 0 for f in files)
    totals = [f.bytes_total or 0 for f in files]
    if totals and all(totals):
        total = sum(totals)
        return f"{_size(done)} of {_size(total)} ({100 * done / total:.0f}%)"
    return f"{_size(done)} so far"


@app.command("list")
def mirror_list(
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Every version the mirror holds or is fetching, and the catalog models that use it."""
    data = call("GET", connect(server, token_file), "/api/v1/mirror", MirrorListing)
    if as_json:
        typer.echo(json.dumps(data.model_dump(mode="json", exclude_unset=True), indent=2))
        return
    versions = data.models or []
    if not versions:
        typer.echo("the mirror holds nothing yet; llmgw ctl mirror fetch SOURCE --model M --version V")
        return
    rows = []
    for v in versions:
        size = _size(v.bytes) if v.state == "present" else _progress(v)
        extra = []
        if v.state == "failed" and v.reason:
            extra.append(f"  failed: {v.reason}")
        rows.append(
            ([v.model, v.version, v.state, str(len(v.files or ())), size, ", ".join(v.used_by or ()) or "-"], extra)
        )
    _print_rows(["MODEL", "VERSION", "STATE", "FILES", "SIZE", "USED BY"], rows)
    if data.base:
        typer.echo(f"\nnodes fetch from {data.base}")


@app.command("fetch")
def mirror_fetch(
    source: str = typer.Argument(..., help="An http(s) URL or hf:ORG/REPO/FILE (a shard set is fetched whole)."),
    model: str = typer.Option(..., "--model", help="The model's directory in the mirror (one level)."),
    version: str = typer.Option(..., "--version", help="The version's directory (one level; a date works well)."),
    as_name: str | None = typer.Option(None, "--as", help="The file name to keep it under."),
    anyway: bool = typer.Option(False, "--anyway", help="Fetch even a GGUF the pinned llama.cpp cannot load."),
    wait: bool = typer.Option(False, "--wait", help="Follow the download until it is present or failed."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Ask the mirror to fetch weights once, for every node to load from inside the network."""
    try:
        body = MirrorFetchRequest(source=source, model=model, version=version, as_=as_name or None, anyway=anyway)
    except ValidationError as exc:
        fail(f"SOURCE, --model and --version need more than blanks ({first_error(exc)})")
    got = call("POST", connect(server, token_file), "/api/v1/mirror/fetch", MirrorVersion, body)
    typer.echo(f"the mirror is fetching {model}/{version}" + (f"; catalog source: {got.url}" if got.url else ""))
    if not wait:
        typer.echo(f"follow it with: llmgw ctl mirror status {model} {version}")
        return
    last = ""
    while True:
        v = call("GET", connect(server, token_file), _path(model, version), MirrorVersion)
        state = v.state
        if state == "fetching":
            line = f"  {_progress(v)}"
            if line != last:
                typer.echo(line)
                last = line
            time.sleep(1.0)
            continue
        if state == "present":
            typer.echo(f"{model}/{version} is present; serve it with: llmgw ctl mirror serve {model} {version}")
            return
        fail(f"{model}/{version} {state}: {v.reason or 'no reason given'}")


@app.command("status")
def mirror_status(
    model: str = typer.Argument(...),
    version: str = typer.Argument(...),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """One version: fetching (with progress), present or failed (with the reason)."""
    v = call("GET", connect(server, token_file), _path(model, version), MirrorVersion)
    if as_json:
        typer.echo(json.dumps(v.model_dump(mode="json", exclude_unset=True), indent=2))
        return
    words = {"fetching": _progress(v), "failed": v.reason or "no reason given"}.get(v.state, "")
    typer.echo(f"{model}/{version}: {v.state}" + (f": {words}" if words else ""))
    for f in v.files or ():
        sha = f"  sha256 {f.sha256}" if f.sha256 else ""
        typer.echo(f"  {f.name}  {f.state}  {_size(f.bytes or f.bytes_done)}{sha}")
    if v.used_by:
        typer.echo(f"used by: {', '.join(v.used_by)}")


@app.command("remove")
def mirror_remove(
    model: str = typer.Argument(...),
    version: str = typer.Argument(...),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    force: bool = typer.Option(False, "--force", help="Remove it even if a catalog model refers to it."),
) -> None:
    """Delete a whole version from the mirror; refused while a catalog model refers to it."""
    call("DELETE", connect(server, token_file), _path(model, version) + ("?force=1" if force else ""), Removed)
    typer.echo(f"removed {model}/{version}")


@app.command("serve")
def mirror_serve(
    model: str = typer.Argument(..., help="The mirrored model."),
    version: str = typer.Argument(..., help="The version (present) to serve."),
    name: str | None = typer.Option(None, "--name", help="The catalog name; default the mirror's model name."),
    gpu_class: str | None = typer.Option(None, "--gpu-class", help="Run on this GPU class; default CPU (GGUF only)."),
    engine: str | None = typer.Option(None, "--engine", help="llamacpp, vllm or sglang; default from the file type."),
    min_: int = typer.Option(1, "--min", help="Replicas always running; 0 loads one on the first request."),
    max_: int | None = typer.Option(None, "--max", help="Most replicas; 0 stops the model."),
    idle_timeout: str | None = typer.Option(
        None, "--idle-timeout", help="With --min 0: stop after this long idle, e.g. 15m."
    ),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Add a catalog model from a mirrored version in one step: engine, source and memory filled in."""
    scaling: dict[str, int | str] = {"min": min_}
    if max_ is not None:
        scaling["max"] = max_
    if idle_timeout:
        scaling["idle_timeout"] = idle_timeout
    body = MirrorServeRequest(name=name, gpu_class=gpu_class, engine=engine, scaling=scaling)
    m = call("POST", connect(server, token_file), _path(model, version) + "/serve", ModelReply, body).model
    profile = (m.profiles or [CatalogProfile()])[0]
    memory = f", {profile.min_memory_gb:g} GB of memory per replica" if profile.min_memory_gb else ""
    typer.echo(f"added {m.name}: {profile.engine} on {profile.gpu_class or 'CPU'}{memory}, from {m.source}")
    idle = m.scaling.idle_timeout if m.scaling else None
    if min_ == 0 and idle:
        typer.echo(f"it loads on the first request and stops after {_duration(idle)} without one")
