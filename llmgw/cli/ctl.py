"""`llmgw ctl`: operator tools. `ctl cert` works on files, not the admin API, so it runs before any server does."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import typer
from pydantic import BaseModel, ValidationError

from llmgw import __version__
from llmgw.cli.admin_client import Admin, ServerOpt, TokenFileOpt, admin_call, connect
from llmgw.cli.common import fail
from llmgw.config import ConfigError, load_server_config
from llmgw.config.server import DEFAULT_ADMIN_CLIENT, DEFAULT_CONFIG_PATH
from llmgw.pki import DEFAULT_PKI_DIR, PKIError, init_ca, issue_admin, issue_client, issue_server, load_cert, san_names
from llmgw.protocol import ProvisionState
from llmgw.protocol.admin import (
    CatalogModel,
    CatalogScaling,
    FabricTestRun,
    FabricTestView,
    ModelAddRequest,
    ModelReply,
    ModelsReply,
    NodeAction,
    NodeLogs,
    NodeRow,
    NodesReply,
    PlacementReply,
    Removed,
    ReplicasReply,
    ScaleRequest,
    ShardFetch,
)
from llmgw.timefmt import short_duration

app = typer.Typer(help="Operate the fleet: certificates, nodes, models.", no_args_is_help=True)
cert_app = typer.Typer(
    help="The fleet's private certificate authority and the certificates it issues.", no_args_is_help=True
)
app.add_typer(cert_app, name="cert")

_DIR_HELP = f"Directory holding the authority (ca.pem, ca-key.pem); default {DEFAULT_PKI_DIR}."
_OUT_HELP = "Directory to write the certificate and key into; default the --dir directory."


@cert_app.command("init-ca")
def cert_init_ca(
    dir: Path = typer.Option(Path(DEFAULT_PKI_DIR), "--dir", help=_DIR_HELP),
    name: str = typer.Option("llmgw fleet CA", "--name", help="The authority's common name."),
    days: int = typer.Option(3650, "--days", help="How long the authority is valid."),
    force: bool = typer.Option(
        False, "--force", help="Replace an existing authority (every certificate must then be issued again)."
    ),
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
    names: list[str] | None = typer.Argument(None, help="Every host name and IP address agents dial."),
    host: list[str] | None = typer.Option(None, "--host", help="Another host name or IP address (may be repeated)."),
    dir: Path = typer.Option(Path(DEFAULT_PKI_DIR), "--dir", help=_DIR_HELP),
    out: Path | None = typer.Option(None, "--out", help=_OUT_HELP),
    days: int = typer.Option(825, "--days", help="How long the certificate is valid."),
) -> None:
    """Issue server.pem and server-key.pem naming every address agents dial, bare IPs included."""
    try:
        written = issue_server(dir, out or dir, [*(names or []), *(host or [])], days=days)
    except PKIError as exc:
        fail(str(exc))
    typer.echo(f"wrote {written.cert} for {', '.join(san_names(load_cert(written.cert)))}")
    typer.echo(f"wrote {written.key} (mode 0600)")


def admin_names(config: Path | None) -> frozenset[str]:
    """The names a node may not take. issue-client runs where the CA's key is kept, which is the control
    plane (server init puts both under /etc/llmgw), so it reads that server.yaml's admin_tls.clients;
    with no server.yaml there only the default administrator's name is reserved."""
    path = config or Path(DEFAULT_CONFIG_PATH)
    if config is None and not path.exists():
        return frozenset({DEFAULT_ADMIN_CLIENT})
    try:
        return load_server_config(path).admin_names
    except ConfigError as exc:
        fail(
            f"{path}: {exc}; issue-client reads it for the administrators' names no node may take "
            "(admin_tls.clients): fix it, or give --config with the control plane's server.yaml"
        )


@cert_app.command("issue-client")
def cert_issue_client(
    node: str = typer.Argument(
        ..., help="The node id (the agent's node_id, or e.g. control-plane for the mirror API)."
    ),
    dir: Path = typer.Option(Path(DEFAULT_PKI_DIR), "--dir", help=_DIR_HELP),
    out: Path | None = typer.Option(None, "--out", help=_OUT_HELP),
    days: int = typer.Option(825, "--days", help="How long the certificate is valid."),
    config: Path | None = typer.Option(
        None,
        "--config",
        help=f"The server.yaml whose admin_tls.clients no node may be named after; default {DEFAULT_CONFIG_PATH} "
        f"when it exists ({DEFAULT_ADMIN_CLIENT} is refused either way).",
    ),
) -> None:
    """Issue NODE.pem and NODE-key.pem: a node's certificate, whose common name is the node id the agent claims."""
    try:
        written = issue_client(dir, out or dir, node, days=days, admin_names=admin_names(config))
    except PKIError as exc:
        fail(str(exc))
    typer.echo(f"wrote {written.cert} (node certificate for {node})")
    typer.echo(f"wrote {written.key} (mode 0600)")
    typer.echo(f"install them on {node} as the agent's tls.cert and tls.key, beside the authority's ca.pem")


@cert_app.command("issue-admin")
def cert_issue_admin(
    name: str = typer.Argument(
        DEFAULT_ADMIN_CLIENT,
        help=f"The administrator's name, listed in admin_tls.clients (default {DEFAULT_ADMIN_CLIENT}).",
    ),
    dir: Path = typer.Option(Path(DEFAULT_PKI_DIR), "--dir", help=_DIR_HELP),
    out: Path | None = typer.Option(None, "--out", help=_OUT_HELP),
    days: int = typer.Option(825, "--days", help="How long the certificate is valid."),
) -> None:
    """Issue NAME.pem and NAME-key.pem: an administrator's certificate, a credential on an admin listener with
    admin_tls whose clients list NAME (a node's certificate never is, whatever its name)."""
    try:
        written = issue_admin(dir, out or dir, name, days=days)
    except PKIError as exc:
        fail(str(exc))
    typer.echo(f"wrote {written.cert} (administrator's certificate for {name})")
    typer.echo(f"wrote {written.key} (mode 0600: whoever holds it administers the fleet)")
    typer.echo(
        f"list {name} in admin_tls.clients of server.yaml, and have ctl present it with "
        f"LLMGW_ADMIN_CERT={written.cert} LLMGW_ADMIN_KEY={written.key}"
    )


Reply = TypeVar("Reply", bound=BaseModel)


def first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    return f"{'.'.join(map(str, e['loc'])) or 'the body'}: {e['msg']}"


def call(
    method: str, admin: Admin, path: str, shape: type[Reply], body: BaseModel | None = None, *, timeout: float = 60.0
) -> Reply:
    """One admin call, its reply read as ``shape`` (protocol.admin).

    The body leaves out what the command did not say, so the server's defaults hold.
    A reply of another shape (a server of another release) is said, not a traceback."""
    sent = None if body is None else body.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    data = admin_call(method, admin, path, sent, timeout=timeout)
    try:
        return shape.model_validate(data)
    except ValidationError as exc:
        fail(
            f"{admin.url}{path} answered in a shape llmgw {__version__} does not read ({first_error(exc)}); "
            "is the server of another release?"
        )


def _ago(ts: float | None) -> str:
    import time

    if not ts:
        return "-"
    return _duration(time.time() - ts) + " ago"


_duration = short_duration  # 45s, 12m, 5h, 3d


def _size(n: float | None) -> str:
    """Bytes in decimal units, as disks and downloads are sold: 300 MB, 1.2 GB."""
    if n is None:
        return "?"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 10 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def _print_rows(headers: list[str], rows: list[tuple[list[str], list[str]]]) -> None:
    """A rich table, and under a row any lines of its own (a download, a failure).

    Rich has no cell spanning the whole width, and a long line put in a cell would
    widen its column for every row; so the table is rendered first (one line per
    row: nothing wraps) and each row's own lines are printed after its line."""
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 2, 0, 0))
    for h in headers:
        table.add_column(h, no_wrap=True)
    for cells, _ in rows:
        table.add_row(*cells)
    console = Console(width=100_000, highlight=False, force_terminal=sys.stdout.isatty())
    with console.capture() as out:
        console.print(table)
    lines = [line.rstrip() for line in out.get().splitlines()]
    typer.echo(lines[0])
    for (_, extra), line in zip(rows, lines[1:], strict=False):
        typer.echo(line)
        for text in extra:
            typer.echo(text)


def _next_try(retry_at: float | None, now: float) -> str:
    """When a failed install is tried again: in how long, and at what time here."""
    import time

    if retry_at is None:
        return ""
    at = time.strftime("%H:%M:%S", time.localtime(retry_at))
    if retry_at > now:
        return f"; next try in {_duration(retry_at - now)} ({at})"
    # Past it and still failed: the agent has not reported since (or its clock is off).
    return f"; next try was due at {at}"


def _engine_words(n: NodeRow, now: float | None = None) -> str:
    """Ready engines with their versions, then the others with what is happening to them."""
    import time

    now = time.time() if now is None else now
    engines = n.engines or {}
    words = [f"{k} {v}".strip() for k, v in engines.items()]
    for engine, st in (n.provision or {}).items():
        if st.state == ProvisionState.READY or engine in engines:
            continue
        text = f"{engine} {st.state.value}"
        if st.detail:
            text += f": {st.detail}"
        pct = st.progress.percent if st.progress is not None else None
        if pct is not None:
            text += f" {pct:.0f}%"
        if st.state == ProvisionState.FAILED:
            text += _next_try(st.retry_at, now)
        words.append(text)
    return ", ".join(words) or "-"


def _label_matches(labels: dict[str, str], want: str) -> bool:
    key, eq, value = want.partition("=")
    if key not in labels:
        return False
    return not eq or str(labels[key]) == value


@app.command("nodes")
def nodes(
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    state: str | None = typer.Option(
        None, "--state", help="Only nodes whose state starts with this: ready, cordoned, draining, unreachable, lost."
    ),
    gpu_class: str | None = typer.Option(None, "--class", help="Only nodes with GPUs of this class, e.g. h100-80g."),
    fabric: str | None = typer.Option(None, "--fabric", help="Only nodes attached to this fabric."),
    label: list[str] | None = typer.Option(
        None, "--label", help="Only nodes with this label, as KEY or KEY=VALUE (may be repeated: all must match)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the nodes shown (after the filters) as JSON."),
) -> None:
    """List the nodes: state, free GPUs, memory, disk, engines, GPU classes, fabrics, replicas, last seen."""
    import json

    data = [
        n
        for n in call("GET", connect(server, token_file), "/api/v1/nodes", NodesReply).nodes
        if (state is None or n.state.startswith(state))
        and (gpu_class is None or gpu_class in (n.classes or ()))
        and (fabric is None or fabric in (n.fabrics or ()))
        and all(_label_matches(n.labels or {}, want) for want in label or ())
    ]
    if as_json:
        typer.echo(json.dumps([n.model_dump(mode="json", exclude_unset=True) for n in data], indent=2))
        return
    if not data:
        filtered = state or gpu_class or fabric or label
        typer.echo("no nodes match" if filtered else "no nodes have joined; start llmgw agent on a node")
        return
    rows = []
    for n in data:
        total, avail = (n.memory.total_bytes, n.memory.available_bytes) if n.memory else (None, None)
        memory = f"{avail / 2**30:.0f}/{total / 2**30:.0f} GiB free" if total and avail is not None else "-"
        dfree, dtotal = n.disk_free_bytes, n.disk_total_bytes
        disk = (
            f"{_size(dfree)} free of {_size(dtotal)}"
            if dfree is not None and dtotal
            else (f"{_size(dfree)} free" if dfree is not None else "-")
        )
        gpus = f"{n.gpus_free or 0}/{n.gpus_total}" if n.gpus_total else "-"
        cells = [
            n.node_id,
            n.state + (" (disconnected)" if n.connected is False else ""),
            gpus,
            memory,
            disk,
            _engine_words(n),
            ", ".join(n.classes or ()) or "-",
            ", ".join(n.fabrics or ()) or "-",
            ", ".join(n.replicas or ()) or "-",
            _ago(n.last_seen),
        ]
        rows.append((cells, [f"  warning: {w}" for w in n.warnings or ()]))
    _print_rows(
        ["NODE", "STATE", "GPUS", "MEM", "DISK", "ENGINES", "CLASSES", "FABRICS", "REPLICAS", "LAST SEEN"], rows
    )


def _fetch_line(fetch: ShardFetch) -> str:
    source = fetch.source or "weights"
    done, total = fetch.bytes_done, fetch.bytes_total
    pct = fetch.percent
    if pct is None and done is not None and total:
        pct = 100.0 * done / total
    if total:
        return f"  fetching {source}: {pct:.0f}% of {_size(total)}"
    if pct is not None:
        return f"  fetching {source}: {pct:.0f}%"
    return f"  fetching {source}: {_size(done or 0)} so far"


@app.command("replicas")
def replicas(
    model: str | None = typer.Option(None, "--model", help="Only this model's replicas."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print the replicas as JSON."),
) -> None:
    """List the replicas the control plane runs: state, nodes, endpoint, age, idle time, downloads in progress."""
    import json
    from urllib.parse import urlencode

    query = f"?{urlencode({'model': model})}" if model else ""
    data = call("GET", connect(server, token_file), f"/api/v1/replicas{query}", ReplicasReply).replicas
    if as_json:
        typer.echo(json.dumps([r.model_dump(mode="json", exclude_unset=True) for r in data], indent=2))
        return
    if not data:
        typer.echo(
            f"no replicas of {model}" if model else "no replicas; add a model with llmgw ctl model add -f model.yaml"
        )
        return
    rows = []
    for r in data:
        shards = r.shards or []
        nodes_ = list(dict.fromkeys(s.node for s in shards if s.node))
        state = r.state + (" (stale profile)" if r.stale else "")
        cells = [
            r.id,
            r.model,
            r.profile or "-",
            state,
            r.pool or "-",
            ", ".join(nodes_) or "-",
            r.endpoint or "-",
            _duration(r.age_s),
            _duration(r.idle_s),
        ]
        extra = []
        for s in shards:
            if s.fetch:
                line = _fetch_line(s.fetch)
                extra.append(line + (f" (on {s.node})" if len(shards) > 1 else ""))
        if r.reason:
            extra.append(f"  {r.reason}")
        rows.append((cells, extra))
    _print_rows(["REPLICA", "MODEL", "PROFILE", "STATE", "POOL", "NODES", "ENDPOINT", "AGE", "IDLE"], rows)


def _node_action(action: str, node: str, admin: Admin) -> None:
    from urllib.parse import quote

    got = call("POST", admin, f"/api/v1/nodes/{quote(node, safe='')}/{action}", NodeAction)
    typer.echo(got.message or f"{got.node} is {got.state or action}")


@app.command("cordon")
def cordon(
    node: str = typer.Argument(..., help="The node's id."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Stop placing new work on a node; what runs there keeps running."""
    _node_action("cordon", node, connect(server, token_file))


@app.command("uncordon")
def uncordon(
    node: str = typer.Argument(..., help="The node's id."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Let a cordoned or drained node take new work again."""
    _node_action("uncordon", node, connect(server, token_file))


@app.command("drain")
def drain(
    node: str = typer.Argument(..., help="The node's id."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Move work off a node, one replica at a time; nothing new is placed there meanwhile."""
    _node_action("drain", node, connect(server, token_file))


model_app = typer.Typer(
    help="Models the control plane runs (added at run time; server.yaml's are changed there).", no_args_is_help=True
)
app.add_typer(model_app, name="model")


def _scaling_words(m: CatalogModel) -> str:
    sc = m.scaling or CatalogScaling()
    return f"{sc.state or '?'} (min {sc.min}, max {sc.max})"


@model_app.command("add")
def model_add(
    file: Path = typer.Option(
        ..., "-f", "--file", help="A YAML file holding one model (name, source, scaling, profiles)."
    ),
    no_source_check: bool = typer.Option(False, "--no-source-check", help="Do not check that the source can be read."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Add a model to the catalog; its source is checked first."""
    from llmgw.config import ConfigError
    from llmgw.server.control.catalog import load_model_file

    try:
        model = load_model_file(file)
    except ConfigError as exc:
        fail(str(exc))
    m = call(
        "POST",
        connect(server, token_file),
        "/api/v1/models",
        ModelReply,
        ModelAddRequest(model=model, source_check=not no_source_check),
    ).model
    typer.echo(f"added {m.name}: {_scaling_words(m)}")


@model_app.command("remove")
def model_remove(
    name: str = typer.Argument(..., help="The model's name."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Remove a model added at run time (one declared in server.yaml is removed there)."""
    call("DELETE", connect(server, token_file), f"/api/v1/models/{name}", Removed)
    typer.echo(f"removed {name}")


@app.command("scale")
def scale(
    name: str = typer.Argument(..., help="The model's name."),
    min_: int = typer.Option(..., "--min", help="Replicas always running; 0 starts it on demand."),
    max_: int | None = typer.Option(None, "--max", help="Most replicas; 0 stops the model."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Set how many replicas of a model run."""
    m = call(
        "PUT", connect(server, token_file), f"/api/v1/models/{name}/scale", ModelReply, ScaleRequest(min=min_, max=max_)
    ).model
    typer.echo(f"{m.name}: {_scaling_words(m)}")


@app.command("models")
def models(
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print the catalog as JSON."),
) -> None:
    """List the catalog: every model, whether server.yaml declares it, its scaling and profiles."""
    import json

    from rich.console import Console
    from rich.table import Table

    data = call("GET", connect(server, token_file), "/api/v1/models", ModelsReply)
    if as_json:
        typer.echo(json.dumps(data.model_dump(mode="json", exclude_unset=True), indent=2))
        return
    for problem in data.problems or ():
        typer.echo(f"warning: {problem}", err=True)
    if not data.models:
        typer.echo("the catalog is empty; add a model with llmgw ctl model add -f model.yaml")
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("MODEL", "FROM", "SCALING", "READY", "PROFILES", "SOURCE"):
        table.add_column(col, no_wrap=True)
    notes: list[str] = []
    for m in data.models:
        profiles = ", ".join(p.name or p.engine or "?" for p in m.profiles or ()) or "static endpoints"
        status = m.status
        ready = "-"
        if status is not None and status.target is not None:
            ready = f"{(status.replicas or {}).get('ready', 0)}/{status.target}"
        table.add_row(
            m.name,
            "server.yaml" if m.declared else "added",
            _scaling_words(m) if m.scaling else "-",
            ready,
            profiles,
            m.source or "-",
        )
        if status is not None and status.backoff is not None:
            b = status.backoff
            notes.append(
                f"{m.name}: {b.failures} failed start(s) in a row, next attempt in "
                f"{_duration(b.retry_in_s)}; last: {b.last_failure}"
            )
        if status is not None and status.problem:
            notes.append(f"{m.name}: {status.problem}")
    Console(highlight=False, width=200).print(table)
    for note in notes:
        typer.echo(note)


@app.command("logs")
def logs(
    node: str = typer.Argument(..., help="The node's id."),
    source: str | None = typer.Option(None, "--source", help="A shard id; default the agent's own log."),
    lines: int = typer.Option(200, "-n", "--lines", help="How many of the last lines."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Show a node's agent log, or a shard's engine output, fetched through the agent's stream."""
    from urllib.parse import urlencode

    query = urlencode({"lines": lines, **({"source": source} if source else {})})
    got = call("GET", connect(server, token_file), f"/api/v1/nodes/{node}/logs?{query}", NodeLogs)
    for line in got.lines or ():
        typer.echo(line)
    if got.sources:
        typer.echo(f"(logs on {node}: {', '.join(got.sources)})", err=True)


@app.command("explain-placement")
def explain_placement(
    name: str = typer.Argument(..., help="The model's name."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print the explanation as JSON."),
) -> None:
    """Say, for every node and each of the model's profiles, whether a replica would be placed there and why."""
    import json

    data = call("GET", connect(server, token_file), f"/api/v1/models/{name}/placement", PlacementReply)
    if as_json:
        typer.echo(json.dumps(data.model_dump(mode="json", exclude_unset=True), indent=2))
        return
    for p in data.profiles:
        typer.echo(f"profile {p.profile}:")
        if p.capacity:
            typer.echo(f"  {p.capacity}")  # what a replica of it was measured to serve (ctl bench --save)
        if p.error:
            typer.echo(f"  {p.error}")
            continue
        if not p.nodes:
            typer.echo("  no nodes have joined; start llmgw agent on a node")
        for n in p.nodes:
            mark = "chosen" if n.chosen else "not chosen"
            typer.echo(f"  {n.node}: {mark}" + ("" if not n.reasons else ": " + "; ".join(n.reasons)))


# A test runs rail after rail, each for --seconds plus the agents' handshakes and,
# the first time, perftest's installation: the spec's client timeout.
FABRIC_TEST_TIMEOUT_S = 30 * 60


@app.command("fabric-test")
def fabric_test(
    node_a: str = typer.Argument(..., help="The node that sends (its agent runs the ib_write_bw client)."),
    node_b: str = typer.Argument(..., help="The node that receives (its agent runs the server)."),
    fabric: str | None = typer.Option(None, "--fabric", help="The fabric to test; default the one both share."),
    seconds: int = typer.Option(3, "--seconds", min=1, max=30, help="How long each rail runs (up to 30)."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Measure RDMA bandwidth between two nodes, rail by rail, and grade each against its link rate.

    Each of A's adapters on the fabric is paired with B's adapter of the same name; the traffic is
    real (perftest's ib_write_bw). Exits 1 unless every rail reached 80 % of its link rate."""
    import json

    from llmgw.protocol.fabric_test import exit_code, render_table

    run = FabricTestRun(a=node_a, b=node_b, fabric=fabric, seconds=seconds)
    view = call(
        "POST", connect(server, token_file), "/api/v1/fabric-test", FabricTestView, run, timeout=FABRIC_TEST_TIMEOUT_S
    )
    if as_json:
        typer.echo(json.dumps(view.model_dump(mode="json"), indent=2))
    else:
        typer.echo(
            render_table(view.a, view.b, view.fabric, view.rails, took_s=view.took_s, notes=view.notes), nl=False
        )
    if exit_code(view.rails) != 0:
        fail("not every rail passed")


# Registered last: it uses the helpers above.
from llmgw.cli import ctl_mirror, ctl_ops, ctl_token  # noqa: E402

app.add_typer(ctl_mirror.app, name="mirror")
app.add_typer(ctl_token.app, name="token")
app.add_typer(ctl_ops.app)  # status, usage, weights, engine-check: commands of ctl itself

from llmgw.cli import ctl_bench  # noqa: E402

app.add_typer(ctl_bench.app)  # bench, capacity: measured capacity (ctl_bench.py)

from llmgw.cli import ctl_plan  # noqa: E402

app.add_typer(ctl_plan.app)  # plan: does a model fit (ctl_plan.py)
