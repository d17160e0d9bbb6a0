"""The whole of `server init` in the spec's order, one line per step through ``emit``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.init import InitError, cluster
from llmgw.init import postgres as pg
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
    # PostgreSQL on this machine for the store: installed when absent, an existing SQLite store moved into it.
    postgres: bool = False
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
    if opts.postgres and opts.store:
        raise InitError("--postgres sets up PostgreSQL on this machine and --store names a store elsewhere; give one")


# The steps in order, by name; numbered as shown, so --postgres's two steps move the later numbers on.
TITLES = {
    "user": "user and directories",
    "authority": "authority",
    "certificate": "server certificate",
    "config": "server.yaml",
    # --postgres only: after server.yaml (which says whether there is a SQLite store to move), before the store.
    "postgres": "PostgreSQL",
    "move": "store to PostgreSQL",
    "store": "store and administrator",
    "credential": "admin credential",
    # The mirror before the server: the server reads the mirror's API token when it starts.
    "mirror": "mirror",
    "unit": "server unit",
    "llamacpp": "llama.cpp in the mirror",
    "node": "this machine as a node",
    "model": "starter model",
}
POSTGRES_ONLY = ("postgres", "move")


def numbering(opts: Options) -> dict[str, int]:
    """Each step's number as shown: the steps this run has, counted from 1."""
    names = [n for n in TITLES if opts.postgres or n not in POSTGRES_ONLY]
    return {name: i for i, name in enumerate(names, 1)}


def server_init(
    m: Machine, opts: Options, steps: Steps | None = None, emit: Callable[[str], None] | None = None
) -> Report:
    """Run the steps in order, each through ``steps`` (plain lines through ``emit`` when not given).
    Raises InitError at the first step that cannot go on, after reporting it FAILED; every step
    before it is done, and a rerun goes on from there."""
    check_options(opts)
    st: Steps = steps if steps is not None else PlainSteps(emit or print)
    rep = Report()
    number = numbering(opts)
    current = [""]

    def begin(name: str) -> str:
        current[0] = name
        key = str(number[name])
        st.begin(key, TITLES[name])
        return key

    def record(name: str, d: Done) -> bool:
        rep.done.append(d)
        st.end(str(number[name]), Status(d.status), d.line)
        return opts.stop_after is not None and number[name] >= opts.stop_after

    try:
        begin("user")
        if record("user", do.user_and_directories(m, manage_user=opts.manage_user)):
            return rep
        begin("authority")
        if record("authority", do.authority(m)):
            return rep
        begin("certificate")
        cert = do.server_certificate(m, opts.hosts)
        if record("certificate", cert):
            return rep
        do.ca_beside(m)
        begin("config")
        plan = mirror_plan(m, opts.hosts, opts.mirror_url, opts.no_mirror)
        # With --postgres a new server.yaml names the DSN file from the start: there is never a SQLite store.
        done, cfg = do.server_config(m, plan, pg.store_ref(m) if opts.postgres else opts.store)
        if record("config", done):
            return rep
        if opts.postgres:
            begin("postgres")
            if record("postgres", pg.postgres(m, cfg)):
                return rep
            begin("move")
            done, cfg = pg.store_to_postgres(m, cfg)
            if record("move", done):
                return rep
        begin("store")
        done, rep.password = do.store_and_admin(m, cfg, opts.admin)
        stop = record("store", done)
        if rep.password:
            st.secret(
                f"administrator {opts.admin.strip().lower()}, password (printed only now; a rerun never resets it)",
                rep.password,
            )
        if stop:
            return rep
        begin("credential")
        if record("credential", do.admin_credential(m, cfg)):
            return rep
        begin("mirror")
        if record("mirror", cluster.mirror(m, cfg, manage_user=opts.manage_user)):
            return rep
        begin("unit")
        if record("unit", do.server_unit(m, cfg, restart=cert.status == "changed")):
            return rep
        key = begin("llamacpp")
        done = cluster.llamacpp(
            m, cfg, st, key, archive=opts.llamacpp_archive, token=lambda: cluster.mirror_token(m, cfg)
        )
        if record("llamacpp", done):
            return rep
        key = begin("node")
        if opts.no_node:
            done = Done("node", "skipped", "this machine is not a node (--no-node)")
        else:
            done = cluster.this_node(m, cfg, st, key, hosts=opts.hosts)
        if record("node", done):
            return rep
        key = begin("model")
        if opts.no_model:
            done = Done("starter model", "skipped", "none (--no-model)")
        elif not m.systemd:
            done = Done("starter model", "skipped", "not added: the control plane is not running here (no systemd)")
        else:
            done = cluster.starter_model(m, cfg, st, key, node_here=not opts.no_node)
        record("model", done)
    except InitError as exc:
        st.end(str(number[current[0]]), Status.FAILED, f"{TITLES[current[0]]}: {exc}")
        raise
    st.note("done." if rep.changed else "done: nothing changed.")
    st.note(f"Add nodes from here: `sudo {m.binary} node add [user@]HOST [more hosts…]` (SSH, with sudo on each).")
    st.note(
        f"Back up {m.pki / 'ca-key.pem'} somewhere safe: every node's certificate comes from it "
        "(keep it here for node add, or move it and give node add --pki DIR)."
    )
    return rep
