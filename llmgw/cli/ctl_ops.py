"""`llmgw ctl status`, `ctl usage`, `ctl weights` and `ctl engine-check`: the cluster at a glance,
who spent what, what is taking the nodes' disks, and whether an engine takes llmgw's flags.

The first three read the admin API (admin/ops.py); `engine-check` is `llmgw agent engine-check`
itself, reachable where operators look for it.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import typer

from llmgw.cli import agent as agent_cli
from llmgw.cli.admin_client import JsonOpt, ServerOpt, TokenFileOpt, connect
from llmgw.cli.common import fail
from llmgw.cli.ctl import _print_rows, _size, call
from llmgw.protocol.admin import ClusterStatus, UsageReply, WeightsCollectReply, WeightsReply

# Annotated: llmgw.cli.ctl imports this module at its end, a cycle mypy cannot infer through.
# Added to `ctl` without a name, so these are `ctl status`, not `ctl ops status`.
app: typer.Typer = typer.Typer()

# The order nodes' states are counted in; any other state a server reports comes after.
NODE_STATES = ("ready", "cordoned", "draining", "unreachable", "lost")
NO_NODES = (
    "no nodes have joined: run `llmgw node add HOST` on this machine to make one a node "
    "(or start `llmgw agent` on a machine whose agent.yaml names this control plane)"
)
NO_MODELS = (
    "no models: add one with `llmgw ctl model add -f model.yaml`, "
    "or serve one the mirror holds with `llmgw ctl mirror serve MODEL VERSION`"
)
NOT_CONTROL_PLANE = (
    "this server is a gateway without a control plane (control.enabled is false in server.yaml): "
    "it places nothing and has no nodes; it routes to the endpoints server.yaml lists"
)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _money(micros: int) -> str:
    """Spend to the cent, or finer where it is under one (as the Usage page shows it)."""
    if 0 < micros < 10_000:
        return f"{micros / 1_000_000:,.6f}".rstrip("0")
    return f"{micros / 1_000_000:,.2f}"


# -- status


def _status_lines(st: ClusterStatus) -> list[str]:
    head = f"llmgw {st.version}, " + ("control plane" if st.control_plane else "gateway")
    lines = [head + (f" ({st.standby})" if st.standby else "")]
    if not st.control_plane:
        lines.append(NOT_CONTROL_PLANE)
        lines.append(f"endpoints: {st.endpoints_available or 0}/{st.endpoints or 0} available")
        lines.extend(f"  {m.name}: {m.ready or 0}/{m.endpoints or 0} endpoints available" for m in st.models)
        return lines
    nodes = st.nodes or {}
    total = sum(nodes.values())
    if not total:
        lines.append(NO_NODES)
    else:
        order = [s for s in NODE_STATES if s in nodes] + sorted(s for s in nodes if s not in NODE_STATES)
        lines.append(f"nodes: {total} (" + ", ".join(f"{nodes[s]} {s}" for s in order) + ")")
    if not st.models:
        lines.append(NO_MODELS)
    else:
        lines.append("models:")
        width = max(len(m.name) for m in st.models)
        for m in st.models:
            if m.managed:
                others = {k: v for k, v in (m.replicas or {}).items() if k != "ready"}
                extra = ", ".join(f"{v} {k}" for k, v in others.items())
                words = f"{m.ready or 0}/{m.target or 0} replicas ready" + (f" ({extra})" if extra else "")
                # A fixed model's count says it all; on demand or stopped explains a zero target.
                words += f"; {m.scaling}" if m.scaling and m.scaling != "fixed" else ""
            else:
                words = f"{m.ready or 0}/{m.endpoints or 0} static endpoints available"
            lines.append(f"  {m.name:<{width}}  {words}")
    lines.extend(
        f"fabric {f.fabric}: {_plural(len(f.models), 'model')} on {f.nodes_used}/{f.nodes_total} nodes"
        + (f" ({', '.join(f.models)})" if f.models else "")
        for f in st.fabrics
    )
    if st.failing:
        lines.append("failing:")
        for t in st.failing:
            who = f"{t.kind} {t.subject}" if t.subject else t.kind
            lines.append(f"  {who}: {t.message}")
    elif total:
        lines.append("nothing is failing")
    return lines


@app.command("status")
def status(server: ServerOpt = None, token_file: TokenFileOpt = None, as_json: JsonOpt = False) -> None:
    """The cluster on one screen: nodes by state, models' replicas against their targets, what each fabric
    carries, and everything failing (failed replicas, nodes' warnings, models backing off)."""
    st = call("GET", connect(server, token_file), "/api/v1/cluster", ClusterStatus)
    if as_json:
        typer.echo(json.dumps(st.model_dump(mode="json", exclude_unset=True), indent=2))
        return
    for line in _status_lines(st):
        typer.echo(line)


# -- usage

_SINCE_UNITS = {"m": timedelta(minutes=1), "h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}


def parse_since(text: str, now: datetime) -> datetime:
    """--since as a duration back from now (30m, 24h, 7d, 2w) or a date or time (UTC unless it says)."""
    m = re.fullmatch(r"\s*(\d+)\s*([mhdw])\s*", text)
    if m and int(m.group(1)) > 0:
        return now - int(m.group(1)) * _SINCE_UNITS[m.group(2)]
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        fail(
            f'--since "{text}" is neither a duration nor a date: write how far back, like 30m, 24h, 7d or 2w, '
            "or when from, like 2025-03-01 or 2025-03-01T12:00 (UTC unless it names a zone)"
        )
    at = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
    if at >= now:
        fail(f'--since "{text}" is not in the past; give a date before now ({now:%Y-%m-%d %H:%M} UTC)')
    return at


@app.command("usage")
def usage(
    by: str = typer.Option(..., "--by", help="Sum per org, team, project or person."),
    since: str = typer.Option(
        "30d", "--since", help="How far back (30m, 24h, 7d, 2w) or from when (2025-03-01, UTC); default 30d."
    ),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Requests, tokens in and out, and spend summed per organization, team, project or person, with the
    budget that very level sets beside it (only where it sets one)."""
    from urllib.parse import urlencode

    levels = ("org", "team", "project", "person")
    if by not in levels:
        fail(f'--by "{by}": group usage by one of {", ".join(levels)}')
    at = parse_since(since, datetime.now(UTC))
    query = urlencode({"by": by, "since": at.isoformat()})
    got = call("GET", connect(server, token_file), f"/api/v1/usage?{query}", UsageReply)
    if as_json:
        typer.echo(json.dumps(got.model_dump(mode="json", exclude_unset=True), indent=2))
        return
    start = datetime.fromisoformat(got.since)
    window = f"since {start:%Y-%m-%d %H:%M} UTC"
    if not got.groups:
        typer.echo(f"no usage {window}")
        return
    typer.echo(f"usage by {by} {window}")
    rows: list[tuple[list[str], list[str]]] = []
    for g in got.groups:
        budget = f"{_money(g.budget_micros)} a {g.budget_period}" if g.budget_micros is not None else "-"
        cells = [g.label, f"{g.requests:,}", f"{g.tokens_in:,}", f"{g.tokens_out:,}", _money(g.spend_micros), budget]
        rows.append((cells, []))
    totals = [
        "total",
        f"{sum(g.requests for g in got.groups):,}",
        f"{sum(g.tokens_in for g in got.groups):,}",
        f"{sum(g.tokens_out for g in got.groups):,}",
        _money(sum(g.spend_micros for g in got.groups)),
        "",
    ]
    rows.append((totals, []))
    _print_rows([by.upper(), "REQUESTS", "TOKENS IN", "TOKENS OUT", "SPEND", "BUDGET"], rows)
    if not got.priced:
        typer.echo("no model has a price (auth.pricing or auth.default_price in server.yaml), so nothing is spent")


# -- weights


@app.command("weights")
def weights(
    collect: bool = typer.Option(
        False, "--collect", help="Ask each node to remove the files listed (each removes only what it fetched)."
    ),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Files llmgw downloaded into the nodes' weights caches that no model in the catalog needs, per node,
    with sizes; files an operator placed are never listed nor removed."""
    admin = connect(server, token_file)
    if collect:
        _collect(call("POST", admin, "/api/v1/weights/collect", WeightsCollectReply), as_json)
        return
    got = call("GET", admin, "/api/v1/weights", WeightsReply)
    if as_json:
        typer.echo(json.dumps(got.model_dump(mode="json", exclude_unset=True), indent=2))
        return
    rows: list[tuple[list[str], list[str]]] = []
    used = used_bytes = 0
    nodes_with: set[str] = set()
    for n in got.nodes:
        for f in n.files:
            if f.used_by:
                used += 1
                used_bytes += f.size_bytes or 0
                continue
            nodes_with.add(n.node)
            where = n.node + ("" if n.connected is not False else " (disconnected)")
            rows.append(([where, _size(f.size_bytes), f.path + (" (shared)" if f.shared else "")], []))
    kept = f"not shown: {_plural(used, 'file')} ({_size(used_bytes)}) that models need"
    if not rows:
        typer.echo(f"no model-less files in the nodes' weights caches; {kept}")
        return
    _print_rows(["NODE", "SIZE", "FILE"], rows)
    unused_bytes = sum(f.size_bytes or 0 for n in got.nodes for f in n.files if not f.used_by)
    typer.echo(
        f"{_plural(len(rows), 'file')} ({_size(unused_bytes)}) no model needs on {_plural(len(nodes_with), 'node')}; "
        f"{kept}; `llmgw ctl weights --collect` asks the nodes to remove them"
    )


def _collect(got: WeightsCollectReply, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(got.model_dump(mode="json", exclude_unset=True), indent=2))
        return
    if not got.nodes:
        typer.echo("no node holds files no model needs; nothing to ask")
        return
    files = size = nodes = 0
    for a in got.nodes:
        if a.sent is False:
            typer.echo(f"{a.node}: not asked: {a.error}")
            continue
        files += len(a.paths)
        size += a.size_bytes
        nodes += 1
        typer.echo(f"{a.node}: asked to remove {_plural(len(a.paths), 'file')} ({_size(a.size_bytes)})")
        if a.error:
            typer.echo(f"{a.node}: kept some: {a.error}")
    typer.echo(
        f"asked to remove {_plural(files, 'file')} ({_size(size)}) on {_plural(nodes, 'node')}; each node removes "
        "only what it fetched itself, and `llmgw ctl weights` shows what is left after their next heartbeat"
    )
    if nodes < len(got.nodes):
        raise typer.Exit(1)


# -- engine-check: the agent's command itself (the check runs here, on this machine's binary)

app.command("engine-check")(agent_cli.engine_check)
