"""The whole of `server init` in the spec's order, one line per step through ``emit``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.init import InitError, steps
from llmgw.init.machine import Machine
from llmgw.init.steps import Done


@dataclass
class Options:
    admin: str
    hosts: list[str] = field(default_factory=list)
    mirror_url: str | None = None
    no_mirror: bool = False
    no_node: bool = False
    no_model: bool = False
    manage_user: bool = True
    stop_after: int | None = None  # the last step to run (an interrupted run, in tests)


@dataclass
class Report:
    done: list[Done] = field(default_factory=list)
    password: str | None = None

    @property
    def changed(self) -> bool:
        return any(d.status in ("made", "changed") for d in self.done)


def check_options(opts: Options) -> None:
    email = opts.admin.strip()
    if "@" not in email or email.startswith("@") or email.endswith("@") or any(c.isspace() for c in email):
        raise InitError(
            f"--admin {opts.admin!r} is not an email address; give the administrator's, e.g. you@example.com"
        )
    if opts.mirror_url and opts.no_mirror:
        raise InitError("--mirror URL and --no-mirror contradict each other; give one")


def not_built_lines(opts: Options, binary: str) -> list[str]:
    """Steps 8-10, which `server init` does not do yet: what the operator does instead today."""
    lines = []
    if opts.mirror_url:
        lines.append(
            f"mirror: using the mirror at {opts.mirror_url} (mirror.api in server.yaml); copy its API token "
            "to a file the llmgw user reads and set mirror.token_file"
        )
    elif opts.no_mirror:
        lines.append("mirror: none here (--no-mirror)")
    else:
        lines.append(
            "mirror: not done (running one beside the control plane is not built into init yet); run "
            f"`sudo {binary} mirror init --control-plane 127.0.0.1` and add the mirror block it prints to server.yaml"
        )
    if opts.no_node:
        lines.append("node: this machine is not a node (--no-node)")
    else:
        lines.append(
            "node: not done (making this machine a node is not built into init yet); issue its certificate "
            f"with `{binary} ctl cert issue-client NODE`, write /etc/llmgw/agent.yaml and run `{binary} agent`"
        )
    if opts.no_model:
        lines.append("starter model: none (--no-model)")
    else:
        lines.append(
            "starter model: not done (fetching one is not built into init yet); add a model with "
            f"`{binary} ctl model add`"
        )
    return lines


def server_init(m: Machine, opts: Options, emit: Callable[[str], None] = print) -> Report:
    """Run steps 1-7 (then say what 8-10 do not do yet). Raises InitError at the first step that cannot go on;
    every step before it is done, and a rerun goes on from there."""
    check_options(opts)
    rep = Report()

    def record(n: int, d: Done) -> bool:
        rep.done.append(d)
        emit(f"{n}. {d.line}")
        return opts.stop_after is not None and n >= opts.stop_after

    if record(1, steps.user_and_directories(m, manage_user=opts.manage_user)):
        return rep
    if record(2, steps.authority(m)):
        return rep
    cert = steps.server_certificate(m, opts.hosts)
    if record(3, cert):
        return rep
    steps.ca_beside(m)
    done, cfg = steps.server_config(m, opts.mirror_url)
    if record(4, done):
        return rep
    done, rep.password = steps.store_and_admin(m, cfg, opts.admin)
    stop = record(5, done)
    if rep.password:
        emit(f"   administrator {opts.admin.strip().lower()}, password: {rep.password}")
        emit("   (printed only now: keep it; a rerun never resets it)")
    if stop:
        return rep
    if record(6, steps.admin_credential(m, cfg)):
        return rep
    restart = cert.status == "changed"
    if record(7, steps.server_unit(m, cfg, restart=restart)):
        return rep
    for i, line in enumerate(not_built_lines(opts, m.binary), start=8):
        emit(f"{i}. {line}")
    emit("done." if rep.changed else "done: nothing changed.")
    emit(f"Back up {m.pki / 'ca-key.pem'}: every node's certificate comes from it.")
    return rep
