"""`llmgw ctl`: operator tools. `ctl cert` works on files, not the admin API, so it runs before any server does."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from llmgw.cli.common import fail
from llmgw.pki import DEFAULT_PKI_DIR, PKIError, init_ca, issue_client, issue_server, load_cert, san_names

app = typer.Typer(help="Operate the fleet: certificates, nodes, models.", no_args_is_help=True)
cert_app = typer.Typer(help="The fleet's private certificate authority and the certificates it issues.", no_args_is_help=True)
app.add_typer(cert_app, name="cert")

_DIR_HELP = f"Directory holding the authority (ca.pem, ca-key.pem); default {DEFAULT_PKI_DIR}."
_OUT_HELP = "Directory to write the certificate and key into; default the --dir directory."


@cert_app.command("init-ca")
def cert_init_ca(
    dir: Path = typer.Option(Path(DEFAULT_PKI_DIR), "--dir", help=_DIR_HELP),
    name: str = typer.Option("llmgw fleet CA", "--name", help="The authority's common name."),
    days: int = typer.Option(3650, "--days", help="How long the authority is valid."),
    force: bool = typer.Option(False, "--force", help="Replace an existing authority (every certificate must then be issued again)."),
) -> None:
    """Create the authority: ca.pem to trust on every machine, ca-key.pem to keep here and back up."""
    try:
        out = init_ca(dir, name=name, days=days, force=force)
    except PKIError as exc:
        fail(str(exc))
    typer.echo(f"wrote {out.cert} (the authority's certificate: every node and server trusts it)")
    typer.echo(f"wrote {out.key} (its key, mode 0600: back it up; losing it means reissuing every node's certificate)")


@cert_app.command("issue-server")
def cert_issue_server(
    names: Optional[list[str]] = typer.Argument(None, help="Every host name and IP address agents dial."),
    host: Optional[list[str]] = typer.Option(None, "--host", help="Another host name or IP address (may be repeated)."),
    dir: Path = typer.Option(Path(DEFAULT_PKI_DIR), "--dir", help=_DIR_HELP),
    out: Optional[Path] = typer.Option(None, "--out", help=_OUT_HELP),
    days: int = typer.Option(825, "--days", help="How long the certificate is valid."),
) -> None:
    """Issue server.pem and server-key.pem naming every address agents dial, bare IPs included."""
    try:
        written = issue_server(dir, out or dir, [*(names or []), *(host or [])], days=days)
    except PKIError as exc:
        fail(str(exc))
    typer.echo(f"wrote {written.cert} for {', '.join(san_names(load_cert(written.cert)))}")
    typer.echo(f"wrote {written.key} (mode 0600)")


@cert_app.command("issue-client")
def cert_issue_client(
    node: str = typer.Argument(..., help="The node id (the agent's node_id, or e.g. control-plane for the mirror API)."),
    dir: Path = typer.Option(Path(DEFAULT_PKI_DIR), "--dir", help=_DIR_HELP),
    out: Optional[Path] = typer.Option(None, "--out", help=_OUT_HELP),
    days: int = typer.Option(825, "--days", help="How long the certificate is valid."),
) -> None:
    """Issue NODE.pem and NODE-key.pem whose common name is the node id the agent claims."""
    try:
        written = issue_client(dir, out or dir, node, days=days)
    except PKIError as exc:
        fail(str(exc))
    typer.echo(f"wrote {written.cert} (client certificate for {node})")
    typer.echo(f"wrote {written.key} (mode 0600)")
    typer.echo(f"install them on {node} as the agent's tls.cert and tls.key, beside the authority's ca.pem")


ADMIN_HELP = "The control plane's admin address (admin_listen)."


def _admin_get(admin: str, path: str) -> dict:
    return admin_call("GET", admin, path)


def admin_call(method: str, admin: str, path: str, body: dict | None = None) -> dict:
    import httpx

    url = admin.rstrip("/") + path
    try:
        # A source check may fetch a manifest from far away: give it time.
        r = httpx.request(method, url, json=body, timeout=60)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the control plane's admin API at {admin}: {exc}; is llmgw server running, "
             "and is --admin its admin_listen?")
    if r.status_code not in (200, 201):
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        fail(f"{url} answered {r.status_code}: {message}")
    return r.json()


def _ago(ts: float | None) -> str:
    import time

    if not ts:
        return "-"
    s = max(0, time.time() - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


@app.command("nodes")
def nodes(
    admin: str = typer.Option("http://127.0.0.1:9090", "--admin", help=ADMIN_HELP),
    state: Optional[str] = typer.Option(None, "--state", help="Only nodes in this state: ready, unreachable or lost."),
    as_json: bool = typer.Option(False, "--json", help="Print the nodes as JSON."),
) -> None:
    """List the nodes that joined the control plane: state, memory, GPUs, engines, shards, last seen."""
    import json

    from rich.console import Console
    from rich.table import Table

    data = [n for n in _admin_get(admin, "/api/v1/nodes")["nodes"] if state is None or n["state"] == state]
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    if not data:
        typer.echo("no nodes" + (f" in state {state}" if state else " have joined; start llmgw agent on a node"))
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("NODE", "STATE", "MEMORY", "GPUS", "ENGINES", "SHARDS", "LAST SEEN"):
        table.add_column(col, no_wrap=True)
    for n in data:
        mem = n.get("memory") or {}
        total, avail = mem.get("total_bytes"), mem.get("available_bytes")
        memory = f"{avail / 2**30:.0f}/{total / 2**30:.0f} GiB free" if total and avail is not None else "-"
        engines = ", ".join(f"{k} {v}" for k, v in (n.get("engines") or {}).items())
        installing = [f"{k}: {v.get('state')}" for k, v in (n.get("provision") or {}).items()
                      if v.get("state") != "ready"]
        shards = ", ".join(f"{k} {v.get('state')}" for k, v in (n.get("shards") or {}).items())
        table.add_row(n["node_id"], n["state"] + ("" if n["connected"] else " (disconnected)"), memory,
                      str(n.get("gpus") or 0), "; ".join(filter(None, [engines, *installing])) or "-",
                      shards or "-", _ago(n.get("last_seen")))
    Console(highlight=False, width=200).print(table)


model_app = typer.Typer(help="Models the control plane runs (added at run time; server.yaml's are changed there).",
                        no_args_is_help=True)
app.add_typer(model_app, name="model")


def _scaling_words(m: dict) -> str:
    sc = m.get("scaling") or {}
    return f"{sc.get('state', '?')} (min {sc.get('min')}, max {sc.get('max')})"


@model_app.command("add")
def model_add(
    file: Path = typer.Option(..., "-f", "--file", help="A YAML file holding one model (name, source, scaling, profiles)."),
    no_source_check: bool = typer.Option(False, "--no-source-check", help="Do not check that the source can be read."),
    admin: str = typer.Option("http://127.0.0.1:9090", "--admin", help=ADMIN_HELP),
) -> None:
    """Add a model to the catalog; its source is checked first."""
    from llmgw.config import ConfigError
    from llmgw.server.control.catalog import load_model_file

    try:
        model = load_model_file(file)
    except ConfigError as exc:
        fail(str(exc))
    m = admin_call("POST", admin, "/api/v1/models", {"model": model, "source_check": not no_source_check})["model"]
    typer.echo(f"added {m['name']}: {_scaling_words(m)}")


@model_app.command("remove")
def model_remove(
    name: str = typer.Argument(..., help="The model's name."),
    admin: str = typer.Option("http://127.0.0.1:9090", "--admin", help=ADMIN_HELP),
) -> None:
    """Remove a model added at run time (one declared in server.yaml is removed there)."""
    admin_call("DELETE", admin, f"/api/v1/models/{name}")
    typer.echo(f"removed {name}")


@app.command("scale")
def scale(
    name: str = typer.Argument(..., help="The model's name."),
    min_: int = typer.Option(..., "--min", help="Replicas always running; 0 starts it on demand."),
    max_: Optional[int] = typer.Option(None, "--max", help="Most replicas; 0 stops the model."),
    admin: str = typer.Option("http://127.0.0.1:9090", "--admin", help=ADMIN_HELP),
) -> None:
    """Set how many replicas of a model run."""
    body = {"min": min_} if max_ is None else {"min": min_, "max": max_}
    m = admin_call("PUT", admin, f"/api/v1/models/{name}/scale", body)["model"]
    typer.echo(f"{m['name']}: {_scaling_words(m)}")


@app.command("models")
def models(
    admin: str = typer.Option("http://127.0.0.1:9090", "--admin", help=ADMIN_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the catalog as JSON."),
) -> None:
    """List the catalog: every model, whether server.yaml declares it, its scaling and profiles."""
    import json

    from rich.console import Console
    from rich.table import Table

    data = _admin_get(admin, "/api/v1/models")
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    for problem in data.get("problems") or ():
        typer.echo(f"warning: {problem}", err=True)
    if not data["models"]:
        typer.echo("the catalog is empty; add a model with llmgw ctl model add -f model.yaml")
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("MODEL", "FROM", "SCALING", "PROFILES", "SOURCE"):
        table.add_column(col, no_wrap=True)
    for m in data["models"]:
        profiles = ", ".join(p.get("name") or p.get("engine", "?") for p in m.get("profiles") or ()) or "static endpoints"
        table.add_row(m["name"], "server.yaml" if m.get("declared") else "added", _scaling_words(m) if m.get("scaling") else "-",
                      profiles, m.get("source") or "-")
    Console(highlight=False, width=200).print(table)


@app.command("logs")
def logs(
    node: str = typer.Argument(..., help="The node's id."),
    source: Optional[str] = typer.Option(None, "--source", help="A shard id; default the agent's own log."),
    lines: int = typer.Option(200, "-n", "--lines", help="How many of the last lines."),
    admin: str = typer.Option("http://127.0.0.1:9090", "--admin", help=ADMIN_HELP),
) -> None:
    """Show a node's agent log, or a shard's engine output, fetched through the agent's stream."""
    from urllib.parse import urlencode

    query = urlencode({"lines": lines, **({"source": source} if source else {})})
    data = _admin_get(admin, f"/api/v1/nodes/{node}/logs?{query}")
    for line in data["lines"]:
        typer.echo(line)
    if data.get("sources"):
        typer.echo(f"(logs on {node}: {', '.join(data['sources'])})", err=True)


@app.command("explain-placement")
def explain_placement(
    name: str = typer.Argument(..., help="The model's name."),
    admin: str = typer.Option("http://127.0.0.1:9090", "--admin", help=ADMIN_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the explanation as JSON."),
) -> None:
    """Say, for every node and each of the model's profiles, whether a replica would be placed there and why."""
    import json

    data = _admin_get(admin, f"/api/v1/models/{name}/placement")
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    for p in data["profiles"]:
        typer.echo(f"profile {p['profile']}:")
        if p.get("error"):
            typer.echo(f"  {p['error']}")
            continue
        if not p["nodes"]:
            typer.echo("  no nodes have joined; start llmgw agent on a node")
        for n in p["nodes"]:
            mark = "chosen" if n["chosen"] else "not chosen"
            typer.echo(f"  {n['node']}: {mark}" + ("" if not n["reasons"] else ": " + "; ".join(n["reasons"])))
