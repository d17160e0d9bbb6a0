"""`llmgw node`: adding machines to the fleet over SSH, and forgetting them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from llmgw.cli.admin_client import ServerOpt, TokenFileOpt, admin_call, connect
from llmgw.cli.common import fail
from llmgw.cli.ctl import call
from llmgw.protocol.admin import NodesReply, Removed

app = typer.Typer(help="The fleet's nodes.", no_args_is_help=True)


def _plain_steps():
    from llmgw.progress import PlainSteps

    return PlainSteps(typer.echo)


def _interactive(plain: bool) -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty() and not plain


@app.command("add")
def add(
    hosts: list[str] = typer.Argument(..., help="The machines, as [user@]host; added in turn."),
    fabric: list[str] | None = typer.Option(
        None, "--fabric", help="NAME:hca1,hca2 — the fabric the node's adapters are on (repeatable)."
    ),
    ignore_checks: bool = typer.Option(False, "--ignore-checks", help="Go on past what doctor found."),
    wait: bool = typer.Option(False, "--wait", help="Also wait until vLLM is installed."),
    no_wait: bool = typer.Option(False, "--no-wait", help="Wait neither for the node to join nor for its engines."),
    node: str = typer.Option(None, "--node", help="The node's id (default its host name); one host only."),
    server: str = typer.Option(
        None, "--server", help="The URL the agent dials (default this machine's address on the route to the node)."
    ),
    pki: Path = typer.Option(Path("/etc/llmgw/pki"), "--pki", help="Where the authority is."),
    identity: str = typer.Option(None, "--identity", help="The SSH private key to log in with."),
    port: int = typer.Option(22, "--port", help="The SSH port."),
    release_url: str = typer.Option(
        None, "--release-url", help="llmgw's releases, for a node of another architecture than this machine."
    ),
    config: Path = typer.Option(Path("/etc/llmgw/server.yaml"), "--config", help="This control plane's server.yaml."),
    plain: bool = typer.Option(False, "--plain", help="One line per step, even in a terminal."),
) -> None:
    """Make machines nodes over SSH, from the control plane: push this llmgw, run doctor there, install the
    node's certificate, agent.yaml and unit, and wait until it joins with llama.cpp. A rerun is safe."""
    from llmgw.onboard import OnboardError
    from llmgw.onboard.add import AddOptions, Fabric, add_nodes

    if wait and no_wait:
        fail("--wait and --no-wait contradict each other; give one")
    try:
        opts = AddOptions(
            hosts=hosts,
            port=port,
            identity=identity,
            fabrics=[Fabric.parse(f) for f in fabric or []],
            ignore_checks=ignore_checks,
            wait_vllm=wait,
            no_wait=no_wait,
            node_id=node,
            server=server,
            pki=pki,
            config=config,
            release_url=release_url,
        )
        if _interactive(plain):
            from llmgw.cli.screens import run_steps

            outcomes = run_steps(lambda steps: add_nodes(opts, steps), title="llmgw node add")
        else:
            outcomes = add_nodes(opts, _plain_steps())
    except OnboardError as exc:
        fail(str(exc))
    if any(o.error for o in outcomes):
        raise typer.Exit(1)


@app.command("remove")
def remove(
    name: str = typer.Argument(..., help="The node's id."),
    purge: bool = typer.Option(
        False, "--purge", help="Also stop the agent and its engines on the node and remove its unit and files (SSH)."
    ),
    host: str = typer.Option(
        None, "--host", help="With --purge: [user@]host to reach the node at (default root@ its address)."
    ),
    identity: str = typer.Option(None, "--identity", help="With --purge: the SSH private key to log in with."),
    port: int = typer.Option(22, "--port", help="With --purge: the SSH port."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Forget a node gone for good: a lost one (silent for control.lost_after), or an unreachable one with
    nothing placed on it. Anything else is refused with its state: drain it and stop its agent, or wait
    until it is lost. --purge first stops the agent on the node and removes what node add put there."""
    admin = connect(server, token_file)
    if not purge:
        got = call("DELETE", admin, f"/api/v1/nodes/{name}", Removed)
        typer.echo(f"removed {got.removed}")
        return
    from llmgw.onboard import OnboardError
    from llmgw.onboard.purge import purge_node
    from llmgw.onboard.ssh import Target

    row = next((n for n in call("GET", admin, "/api/v1/nodes", NodesReply).nodes if n.node_id == name), None)
    if row is None:
        fail(f"no node named {name} is known to the control plane; nothing was touched")
    if row.replicas:
        fail(
            f"{name} has {', '.join(row.replicas)} placed on it; drain it first (`llmgw ctl drain {name}`) "
            "so they move, then purge it. Nothing was touched"
        )
    where = host or (f"root@{row.mgmt_addr}" if row.mgmt_addr else None)
    if where is None:
        fail(f"the control plane does not know {name}'s address; give --host [user@]HOST")
    try:
        purge_node(Target.parse(where, port), _plain_steps(), identity=identity)
    except OnboardError as exc:
        fail(str(exc))
    # The agent is gone: the node is removable once it is unreachable (control.unreachable_after).
    from llmgw.admin_api import AdminAPIError, request

    deadline = time.monotonic() + 120
    while True:
        r = None
        for token, _ in admin.tokens or [("", "")]:
            try:
                r = request("DELETE", f"{admin.url}/api/v1/nodes/{name}", token or None, verify=admin.verify)
            except AdminAPIError as exc:
                fail(str(exc))
            if r.status_code != 401:
                break
        assert r is not None
        if r.status_code == 200:
            typer.echo(f"removed {name}")
            return
        if time.monotonic() > deadline:
            admin_call("DELETE", admin, f"/api/v1/nodes/{name}")  # says the server's refusal and exits
        time.sleep(1.0)
