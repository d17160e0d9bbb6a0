"""`llmgw server` (runs the gateway) and `llmgw server init` (makes this machine a control plane)."""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import typer

from llmgw.cli.common import fail, load_config_or_fail
from llmgw.config.server import DEFAULT_CONFIG_PATH

app = typer.Typer(
    help="Run the gateway: the OpenAI-compatible API on `listen`, the admin API and metrics on `admin_listen`, "
    "metrics on `metrics_listen`. `llmgw server init` makes this machine a control plane.",
)


@app.callback(invoke_without_command=True)
def server(
    ctx: typer.Context,
    config: str = typer.Option(DEFAULT_CONFIG_PATH, "--config", "-c", help="Path of server.yaml."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    worker: str = typer.Option(
        None, "--worker", hidden=True, help="SLOT:FD:N:LIMITS_FD, given by `llmgw server` itself."
    ),
) -> None:
    """Run the gateway: the OpenAI-compatible API on `listen`, the admin API and metrics on `admin_listen`, metrics on `metrics_listen`."""
    if ctx.invoked_subcommand is not None:
        return
    from llmgw.runtime import run_until_stopped, setup_logging
    from llmgw.server import StartError
    from llmgw.server.app import serve_until_stopped

    if worker is not None:
        # One of the server's workers (server/workers.py): its configuration comes from the server process.
        from llmgw.server.workers import WorkerError, parse_worker_arg, serve_worker

        setup_logging(log_level)
        try:
            slot, fd, count, limits_fd = parse_worker_arg(worker)
            run_until_stopped(partial(serve_worker, slot, fd, count, limits_fd))
        except (StartError, WorkerError) as exc:
            fail(str(exc))
        return

    cfg = load_config_or_fail(config)
    setup_logging(log_level)
    try:
        run_until_stopped(partial(serve_until_stopped, cfg))
    except StartError as exc:
        fail(str(exc))


NOT_ROOT = (
    "server init must run as root (`sudo llmgw server init --admin you@example.com`): it creates the system "
    "user llmgw and writes /etc/llmgw, /var/lib/llmgw and a systemd unit. To try it without root, give "
    "--root DIR, a directory standing for / (nothing outside it is touched, no user is created)"
)


@app.command("init")
def init(
    admin: str = typer.Option(
        None, "--admin", help="The administrator's email; their password is generated and printed once."
    ),
    host: list[str] | None = typer.Option(
        None,
        "--host",
        help="Another name or address nodes reach this machine by (DNS alias, NAT, floating IP); repeatable.",
    ),
    mirror: str = typer.Option(
        None, "--mirror", help="Use the mirror whose management API is at URL, e.g. http://models:8082."
    ),
    no_mirror: bool = typer.Option(False, "--no-mirror", help="Run no mirror beside the control plane."),
    no_node: bool = typer.Option(False, "--no-node", help="Do not make this machine a node."),
    no_model: bool = typer.Option(False, "--no-model", help="Do not fetch and serve the starter model."),
    plain: bool = typer.Option(False, "--plain", help="One line per step, even in a terminal."),
    llamacpp_archive: Path = typer.Option(
        None,
        "--llamacpp-archive",
        help="A llama.cpp release archive (.tar.gz or .zip holding llama-server) for the mirror to offer nodes, "
        "when GitHub's releases cannot be reached from here.",
    ),
    store: str = typer.Option(
        None, "--store", help="A PostgreSQL DSN for the store (postgresql://user@host/db); default SQLite here."
    ),
    postgres: bool = typer.Option(
        False,
        "--postgres",
        help="The store on PostgreSQL on this machine: installed when absent, role and database llmgw made with "
        "the DSN in /etc/llmgw/secrets/store-dsn, an existing SQLite store moved into it (back on SQLite if "
        "that fails).",
    ),
    root: Path = typer.Option(None, "--root", hidden=True, help="A directory standing for / (tests, trials)."),
) -> None:
    """Make this machine a control plane: user, authority, certificate, server.yaml, (with --postgres: PostgreSQL,
    the store moved to it), store and administrator, admin token, unit, a mirror beside it holding llama.cpp,
    this machine as a node, the starter model.
    Every step looks before it acts: a rerun finishes an interrupted one and changes nothing on a finished one."""
    from llmgw.init import InitError
    from llmgw.init.machine import Machine, machine_addresses, own_binary
    from llmgw.init.run import Options, server_init
    from llmgw.progress import PlainSteps

    interactive = sys.stdin.isatty() and sys.stdout.isatty() and not plain
    if admin is None and not interactive:
        fail("--admin EMAIL is required without a terminal: the administrator's account is made for it")
    is_root = os.geteuid() == 0
    if root is None and not is_root:
        fail(NOT_ROOT)
    real = root is None or root.resolve() == Path("/")
    if postgres and not real:
        # Its package manager, psql and systemctl act on the machine itself, never inside --root.
        fail("--postgres installs and sets up PostgreSQL on this machine itself; it cannot be tried under --root")
    m = Machine(
        root=Path("/") if root is None else root.resolve(),
        addresses=machine_addresses(),
        binary=own_binary(),
        give_files=real and is_root,
    )
    opts = Options(
        admin=admin or "",
        hosts=list(host or []),
        mirror_url=mirror,
        no_mirror=no_mirror,
        no_node=no_node,
        no_model=no_model,
        manage_user=real and is_root,
        llamacpp_archive=str(llamacpp_archive) if llamacpp_archive else None,
        store=store,
        postgres=postgres,
    )
    if admin is None:
        from llmgw.cli.screens import init_form

        answers = init_form(names=m.names, addresses=m.addresses, opts=opts)
        if answers is None:
            fail("server init cancelled: nothing was changed")
        opts = answers
    try:
        if interactive:
            from llmgw.cli.screens import run_steps

            run_steps(lambda steps: server_init(m, opts, steps), title="llmgw server init")
        else:
            server_init(m, opts, PlainSteps(typer.echo))
    except InitError as exc:
        fail(f"{exc}\nEvery step before this one is done; run init again once it is fixed.")
