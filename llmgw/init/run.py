"""The whole of `server init` in the spec's order, one line per step through ``emit``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.init import InitError, cluster
from llmgw.init import steps as do
from llmgw.init.machine import Machine
from llmgw.init.plan import mirror_plan
from llmgw.init.steps import Done
from llmgw.progress import PlainSteps, Status, Steps


@dataclass
class Options:
    admin: str
    hosts: list[str] = field(default_factory=list)
    mirror_url: str | None = None
    no_mirror: bool = False
    no_node: bool = False
    no_model: bool = False
    # A llama.cpp release archive (or llama-server built from source, packed as one) given by the
    # operator: what the mirror offers nodes when GitHub's releases cannot be reached.
    llamacpp_archive: str | None = None
    store: str | None = None  # a PostgreSQL DSN for auth.store; None: SQLite in /var/lib/llmgw
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
        raise InitError(f"{opts.admin!r} is not an email address; give the administrator's, e.g. you@example.com")
    if opts.mirror_url and opts.no_mirror:
        raise InitError("--mirror URL and --no-mirror contradict each other; give one")


TITLES = {
    1: "user and directories",
    2: "authority",
    3: "server certificate",
    4: "server.yaml",
    5: "store and administrator",
    6: "admin credential",
    # The mirror before the server: the server reads the mirror's API token when it starts.
    7: "mirror",
    8: "server unit",
    9: "llama.cpp in the mirror",
    10: "this machine as a node",
    11: "starter model",
}


def server_init(
    m: Machine, opts: Options, steps: Steps | None = None, emit: Callable[[str], None] | None = None
) -> Report:
    """Run the steps in order, each through ``steps`` (plain lines through ``emit`` when not given).
    Raises InitError at the first step that cannot go on, after reporting it FAILED; every step
    before it is done, and a rerun goes on from there."""
    check_options(opts)
    st: Steps = steps if steps is not None else PlainSteps(emit or print)
    rep = Report()
    current = [0]

    def begin(n: int) -> None:
        current[0] = n
        st.begin(str(n), TITLES[n])

    def record(n: int, d: Done) -> bool:
        rep.done.append(d)
        st.end(str(n), Status(d.status), d.line)
        return opts.stop_after is not None and n >= opts.stop_after

    try:
        begin(1)
        if record(1, do.user_and_directories(m, manage_user=opts.manage_user)):
            return rep
        begin(2)
        if record(2, do.authority(m)):
            return rep
        begin(3)
        cert = do.server_certificate(m, opts.hosts)
        if record(3, cert):
            return rep
        do.ca_beside(m)
        begin(4)
        plan = mirror_plan(m, opts.hosts, opts.mirror_url, opts.no_mirror)
        done, cfg = do.server_config(m, plan, opts.store)
        if record(4, done):
            return rep
        begin(5)
        done, rep.password = do.store_and_admin(m, cfg, opts.admin)
        stop = record(5, done)
        if rep.password:
            st.secret(
                f"administrator {opts.admin.strip().lower()}, password (printed only now; a rerun never resets it)",
                rep.password,
            )
        if stop:
            return rep
        begin(6)
        if record(6, do.admin_credential(m, cfg)):
            return rep
        begin(7)
        if record(7, cluster.mirror(m, cfg, manage_user=opts.manage_user)):
            return rep
        begin(8)
        if record(8, do.server_unit(m, cfg, restart=cert.status == "changed")):
            return rep
        begin(9)
        done = cluster.llamacpp(
            m, cfg, st, "9", archive=opts.llamacpp_archive, token=lambda: cluster.mirror_token(m, cfg)
        )
        if record(9, done):
            return rep
        begin(10)
        if opts.no_node:
            done = Done("node", "skipped", "this machine is not a node (--no-node)")
        else:
            done = cluster.this_node(m, cfg, st, "10", hosts=opts.hosts)
        if record(10, done):
            return rep
        begin(11)
        if opts.no_model:
            done = Done("starter model", "skipped", "none (--no-model)")
        elif not m.systemd:
            done = Done("starter model", "skipped", "not added: the control plane is not running here (no systemd)")
        else:
            done = cluster.starter_model(m, cfg, st, "11", node_here=not opts.no_node)
        record(11, done)
    except InitError as exc:
        st.end(str(current[0]), Status.FAILED, f"{TITLES[current[0]]}: {exc}")
        raise
    st.note("done." if rep.changed else "done: nothing changed.")
    st.note(f"Add nodes from here: `sudo {m.binary} node add [user@]HOST [more hosts…]` (SSH, with sudo on each).")
    st.note(
        f"Back up {m.pki / 'ca-key.pem'} somewhere safe: every node's certificate comes from it "
        "(keep it here for node add, or move it and give node add --pki DIR)."
    )
    return rep
