"""`llmgw mirror`: hold model weights for the fleet to fetch from."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from urllib.parse import urlsplit

import typer

from llmgw.cli.admin_client import TokenFileOpt
from llmgw.cli.common import fail
from llmgw.mirror.layout import MirrorError

app = typer.Typer(help="Hold model weights for the fleet to fetch from.", no_args_is_help=True)

DEFAULT_DIR = "/srv/models"
DEFAULT_BASE = "http://localhost:8081"
DEFAULT_SERVER = "127.0.0.1:9090"
# Where init suggests the control plane keeps its copy of the mirror's token.
CONTROL_PLANE_TOKEN = "/etc/llmgw/mirror-token"
_DIR_HELP = "The mirror's root directory (default /srv/models)."
_BASE_HELP = "The address nodes use to reach this mirror, as it appears in catalog sources."
_SERVER_HELP = "Admin API address to read the catalog from."


def _manager(root: str, allow_local_sources: bool = False):
    """The fetcher; a seam tests replace with a stand-in."""
    import os

    from llmgw.huggingface import DEFAULT_ENDPOINT
    from llmgw.mirror.fetcher import Manager

    # The variable huggingface_hub reads, so an internal Hugging Face mirror serves both.
    return Manager(
        Path(root),
        hf_endpoint=os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT,
        allow_local_sources=allow_local_sources,
    )


@app.callback()
def _mirror(ctx: typer.Context, dir: str = typer.Option(DEFAULT_DIR, "--dir", help=_DIR_HELP)) -> None:
    """Hold model weights for the fleet to fetch from."""
    ctx.obj = {"dir": dir}


def _dir(ctx: typer.Context, value: str | None) -> str:
    return value or (ctx.obj or {}).get("dir") or DEFAULT_DIR


def _catalog_sources(server: str, token_file: Path | None) -> list[str]:
    """The catalog's sources, read with the admin credential found the way `llmgw ctl` finds it."""
    from llmgw.cli.admin_client import connect
    from llmgw.mirror.api import read_catalog_sources

    admin = connect(server, token_file)
    return read_catalog_sources(admin.url, tokens=[t for t, _ in admin.tokens], verify=admin.verify)


def _size(n: int | None) -> str:
    from llmgw.cli.ctl import _size as size

    return size(n)


def _with_manager(root: str, op, allow_local_sources: bool = False):
    async def go():
        mgr = _manager(root, allow_local_sources=allow_local_sources)
        try:
            return await op(mgr)
        finally:
            await mgr.close()

    try:
        return asyncio.run(go())
    except MirrorError as exc:
        fail(str(exc))


def _present_rows(versions) -> list[tuple[str, str, str, int]]:
    return [
        (vs.model, vs.version, f.name, f.size or 0)
        for vs in sorted(versions, key=lambda v: (v.model, v.version))
        for f in sorted(vs.files, key=lambda f: f.name)
        if f.state == "present" and not f.name.startswith(".")
    ]


def _print_table(rows: list[tuple[str, str, str, int]]) -> None:
    table = [("MODEL", "VERSION", "FILE", "SIZE")] + [(m, v, f, _size(s)) for m, v, f, s in rows]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for r in table:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])


# ---------------------------------------------------------------- add / fetch


def _add(ctx, url, model, version, as_name, anyway, base, dir, allow_local_sources) -> None:
    root = _dir(ctx, dir)
    if not model or not version:
        fail("--model and --version are required: they are the layout")
    base = base or f"http://{socket.gethostname()}:8081"

    async def op(mgr):
        typer.echo(f"fetching {url}")
        await mgr.fetch(url, model, version, as_name=as_name, anyway=anyway)
        waiter = asyncio.ensure_future(mgr.wait(model, version))
        last = ""
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=2.0)
            vs = mgr.status(model, version)
            if vs is None or waiter.done():
                continue
            done = sum(f.bytes_done or 0 for f in vs.files)
            totals = [f.bytes_total for f in vs.files]
            if totals and None not in totals and sum(totals):
                total = sum(totals)
                line = f"  {_size(done)} of {_size(total)} ({done * 100 // total}%)"
            else:
                line = f"  {_size(done)} so far"
            if line != last:
                typer.echo(line)
                last = line
        return waiter.result()

    vs = _with_manager(root, op, allow_local_sources)
    if vs.state != "present":
        fail(vs.reason or next((f.reason for f in vs.files if f.reason), None) or f"{model}/{version} did not arrive")
    from llmgw.mirror.api import source_url

    names = []
    for f in vs.files:
        names.append(f.name)
        typer.echo(f"\n{model}/{version}/{f.name}  {_size(f.size)}")
        if f.sha256:
            typer.echo(f"  sha256 {f.sha256}")
    typer.echo("\nPoint a model at it with:")
    typer.echo(f"  source: {source_url(base, model, version, names)}")


_URL = typer.Argument(..., help="Where to fetch from: an http(s) URL or hf:ORG/REPO/FILE.")
_MODEL = typer.Option(None, "--model", help="The model's name, one directory level.")
_VERSION = typer.Option(None, "--version", help="One directory level; a date works well.")
_AS = typer.Option(None, "--as", help="File name to keep it under (default: the URL's last path element).")
_ANYWAY = typer.Option(False, "--anyway", help="Keep a GGUF whose architecture llama.cpp may not load.")
_ADD_BASE = typer.Option(
    None, "--base", help="This mirror's address for the source: line (default http://<this host>:8081)."
)
_DIR_OPT = typer.Option(None, "--dir", help=_DIR_HELP)
_ALLOW_LOCAL = typer.Option(
    False,
    "--allow-local-sources",
    help="Fetch from this machine's loopback and link-local addresses too (refused by default: "
    "what the mirror fetches, it serves to anyone who reaches its byte port).",
)


@app.command("add")
def add(
    ctx: typer.Context,
    url: str = _URL,
    model: str = _MODEL,
    version: str = _VERSION,
    as_name: str = _AS,
    anyway: bool = _ANYWAY,
    base: str = _ADD_BASE,
    dir: str = _DIR_OPT,
    allow_local_sources: bool = _ALLOW_LOCAL,
) -> None:
    """Fetch a file into <model>/<version>/ and print the source line for the catalog."""
    _add(ctx, url, model, version, as_name, anyway, base, dir, allow_local_sources)


# Another name for add, kept for the original's scripts: the same command, not a copy.
app.command("fetch", hidden=True, help="Another name for add.")(add)


# ---------------------------------------------------------------- list / unused / remove


@app.command("list")
def list_(ctx: typer.Context, dir: str = _DIR_OPT) -> None:
    """What the mirror holds: every file of every version."""
    root = _dir(ctx, dir)

    async def op(mgr):
        return mgr.list()

    rows = _present_rows(_with_manager(root, op))
    if not rows:
        typer.echo(f"The mirror at {root} is empty.")
        return
    _print_table(rows)
    typer.echo(f"\n{_size(sum(r[3] for r in rows))} in {len(rows)} files.")


@app.command("unused")
def unused(
    ctx: typer.Context,
    server: str = typer.Option(DEFAULT_SERVER, "--server", help=_SERVER_HELP),
    token_file: TokenFileOpt = None,
    base: str = typer.Option(DEFAULT_BASE, "--base", help=_BASE_HELP),
    dir: str = _DIR_OPT,
) -> None:
    """Files no catalog entry refers to."""
    from llmgw.mirror.api import CatalogUnreadable, is_referenced, references

    root = _dir(ctx, dir)
    try:
        sources = _catalog_sources(server, token_file)
    except CatalogUnreadable as exc:
        fail(f"cannot read the catalog, so nothing can be called unused: {exc}")

    async def op(mgr):
        return mgr.list()

    rows = _present_rows(_with_manager(root, op))
    refs = references(sources, base)
    left = [r for r in rows if not is_referenced(refs, r[0], r[1], r[2])]
    if not left:
        typer.echo(f"Every file here is referred to by a model. ({len(rows)} files, {len(sources)} catalog sources.)")
        return
    _print_table(left)
    typer.echo(f"\n{_size(sum(r[3] for r in left))} in {len(left)} files that no model refers to.")
    typer.echo(
        "Before deleting: a node that has to refetch one of these will not be able to. "
        "Retire the catalog entry first, let the fleet settle, then remove."
    )


@app.command("remove")
def remove(
    ctx: typer.Context,
    model: str = typer.Option(None, "--model", help="The model's directory."),
    version: str = typer.Option(None, "--version", help="The version's directory."),
    file: str = typer.Option(None, "--file", help="The file to delete."),
    force: bool = typer.Option(False, "--force", help="Remove without checking the catalog."),
    server: str = typer.Option(DEFAULT_SERVER, "--server", help=_SERVER_HELP),
    token_file: TokenFileOpt = None,
    base: str = typer.Option(DEFAULT_BASE, "--base", help=_BASE_HELP),
    dir: str = _DIR_OPT,
) -> None:
    """Delete one file of a version from the mirror, once no model refers to it."""
    from llmgw.mirror.api import CatalogUnreadable, is_referenced, references

    root = _dir(ctx, dir)
    if not model or not version or not file:
        fail("--model, --version and --file are all required")
    if not force:
        try:
            sources = _catalog_sources(server, token_file)
        except CatalogUnreadable as exc:
            fail(
                f"cannot read the catalog to check whether this is still in use: {exc}\n"
                "  Pass --force to remove it anyway"
            )
        if is_referenced(references(sources, base), model, version, file):
            fail(f"a model still refers to {model}/{version}/{file}; retire the catalog entry first")

    async def op(mgr):
        await mgr.remove_file(model, version, file)

    _with_manager(root, op)
    typer.echo(f"removed {model}/{version}/{file}")


# ---------------------------------------------------------------- serve


def _listen(flag: str, value: str):
    from llmgw.config.types import parse_listen

    try:
        return parse_listen(value)
    except ValueError as exc:
        fail(f"{flag}: {exc}")


@app.command("serve")
def serve(
    ctx: typer.Context,
    listen: str = typer.Option(":8081", "--listen", help="Where nodes fetch bytes (read-only, no credentials)."),
    api_listen: str = typer.Option(":8082", "--api-listen", help="The management API, for the control plane."),
    base: str = typer.Option(DEFAULT_BASE, "--base", help=_BASE_HELP),
    api_allow: list[str] = typer.Option(
        None,
        "--api-allow",
        help="A network filter: the address or network that may reach the API besides this machine (repeatable, comma lists allowed). Not a credential.",
    ),
    api_token_file: str = typer.Option(
        None,
        "--api-token-file",
        help="The API's bearer token, made (mode 0600) when missing (default: <dir>.api-token, beside the directory).",
    ),
    api_name: list[str] = typer.Option(
        None,
        "--api-name",
        help="A further host name the API is reached by (repeatable); this machine's names and the --base host are known.",
    ),
    tls_ca: str = typer.Option(
        None,
        "--tls-ca",
        help="TLS on the API; client certificates from this CA issued to a --tls-client name are a credential.",
    ),
    tls_cert: str = typer.Option(None, "--tls-cert", help="The API's certificate."),
    tls_key: str = typer.Option(None, "--tls-key", help="The API certificate's key."),
    tls_client: list[str] = typer.Option(
        None, "--tls-client", help="A client certificate name that may use the API (repeatable; default control-plane)."
    ),
    allow_local_sources: bool = _ALLOW_LOCAL,
    dir: str = _DIR_OPT,
) -> None:
    """Serve the weights (:8081) and the management API (:8082)."""
    from llmgw.mirror.api import DEFAULT_TLS_CLIENTS, ApiAccess, check_token_place, default_token_file, ensure_token
    from llmgw.mirror.serve import ListenError, describe_api_access, parse_allow, serve_until_stopped
    from llmgw.runtime import run_until_stopped

    root = _dir(ctx, dir)
    if not Path(root).is_dir():
        fail(f"{root} is not a directory to serve")
    addr, api_addr = _listen("--listen", listen), _listen("--api-listen", api_listen)
    try:
        allow = parse_allow(api_allow or [])
        token_file = check_token_place(api_token_file, root) if api_token_file else default_token_file(root)
    except MirrorError as exc:
        fail(str(exc))
    ssl_ctx = None
    given = [x for x in (tls_ca, tls_cert, tls_key) if x]
    if given and len(given) != 3:
        fail("--tls-ca, --tls-cert and --tls-key go together: give all three for TLS, or none")
    if tls_client and not given:
        fail("--tls-client names certificates, which only a TLS listener sees: give --tls-ca, --tls-cert and --tls-key")
    clients = tuple(tls_client or DEFAULT_TLS_CLIENTS) if given else ()
    if given:
        from llmgw.pki import PKIError
        from llmgw.pki.tls import server_context

        try:
            # A client without a certificate may still connect: the token is a credential too.
            ssl_ctx = server_context(tls_ca, tls_cert, tls_key, require_client=False)
        except PKIError as exc:
            fail(str(exc))
    try:
        # Last: bad flags are refused before anything is written.
        token, made = ensure_token(token_file)
    except MirrorError as exc:
        fail(str(exc))
    allow_texts = [a.strip() for v in api_allow or [] for a in v.split(",") if a.strip()]
    api_line = describe_api_access(api_addr, allow_texts, str(token_file), tls_ca, clients)
    access = ApiAccess(
        token=token,
        token_file=str(token_file),
        names=(api_addr.host, urlsplit(base).hostname or "", *(api_name or [])),
        tls_clients=clients,
    )
    if made:
        typer.echo(
            f"made the management API token {token_file} (mode 0600); the control plane needs a copy, "
            "named by mirror.token_file in server.yaml"
        )

    async def main(stop: asyncio.Event) -> None:
        await serve_until_stopped(
            _manager(root, allow_local_sources=allow_local_sources),
            Path(root),
            base,
            access,
            addr,
            api_addr,
            stop,
            api_line=api_line,
            say=typer.echo,
            allow=allow,
            api_ssl=ssl_ctx,
            allow_local_sources=allow_local_sources,
        )

    try:
        run_until_stopped(main)
    except ListenError as exc:
        fail(str(exc))


# ---------------------------------------------------------------- init


@app.command("init")
def init(
    ctx: typer.Context,
    control_plane: str = typer.Option(
        None, "--control-plane", help="The control plane's address; it alone may use the management API."
    ),
    unit_path: str = typer.Option(
        "/etc/systemd/system/llmgw-mirror.service", "--unit-path", help="Where to write the unit."
    ),
    user: str = typer.Option("llmgw", "--user", help="The system user the mirror runs as."),
    base: str = typer.Option(
        None, "--base", help="The address nodes use to reach this mirror (default http://<this host>:8081)."
    ),
    binary: str = typer.Option("/usr/local/bin/llmgw", "--binary", help="The llmgw executable the unit runs."),
    dir: str = _DIR_OPT,
) -> None:
    """Set this machine up as a mirror: the user, the directory, and a systemd unit serving :8081 and :8082."""
    from llmgw.mirror.systemd import init_mirror

    if not control_plane:
        fail("--control-plane is required: only that address may use the management API")
    root = _dir(ctx, dir)
    try:
        res = init_mirror(
            control_plane=control_plane,
            dir=root,
            unit_path=unit_path,
            user=user,
            base=base or f"http://{socket.gethostname()}:8081",
            binary=binary,
            run=_runner,
        )
    except MirrorError as exc:
        fail(str(exc))
    for line in res.changed:
        typer.echo(line)
    if not res.changed:
        typer.echo("Nothing changed: " + "; ".join(res.unchanged) + ".")
    typer.echo(
        f"\nThe management API needs the token in {res.token_file}. On the control plane, copy it to "
        f"{CONTROL_PLANE_TOKEN} (mode 0600, owned by the user `llmgw server` runs as) and add to server.yaml:\n"
        f"  mirror:\n    api: http://{_this_host(base)}:8082\n    token_file: {CONTROL_PLANE_TOKEN}"
    )


def _this_host(base: str | None) -> str:
    return (urlsplit(base).hostname if base else None) or socket.gethostname()


def _runner(argv: list[str]) -> tuple[int, str]:
    """Runs init's commands; a seam tests replace with a recorder."""
    from llmgw.mirror.systemd import run_command

    return run_command(argv)
