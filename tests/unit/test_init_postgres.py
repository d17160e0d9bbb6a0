"""`llmgw server init --postgres`: server.yaml edited as text, the refusals, and the steps' decisions
(install or use what is found, tune only what init installed, move the SQLite store, go back to SQLite
when the gateway does not start on PostgreSQL), run into a temporary root.

A fake runner stands in for pg_lsclusters, the package manager, systemctl and initdb; the SQL init hands
psql runs for real on the PostgreSQL at 127.0.0.1:5432 (skipped without one) under a throwaway role and
database name, except ALTER SYSTEM, which is only recorded: that server is shared.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest
import yaml
from conftest import pg_exec
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.config import load_server_config
from llmgw.init import InitError
from llmgw.init import postgres as pg
from llmgw.init.machine import Machine
from llmgw.init.run import Options, Report, numbering, server_init
from llmgw.init.yamltext import set_store
from llmgw.store import Store

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
HOST_PSQL = shutil.which("psql")
REF = '"@/etc/llmgw/secrets/store-dsn"'

# ------------------------------------------------------------------ server.yaml as text

WRITTEN = """\
# Written by hand: the comments must survive.
listen: ":8080"   # the client port
auth:
  enabled: true   # keys required
  # Where keys live; SQLite by default.
  store: /var/lib/llmgw/llmgw.db  # the old store
  default_rpm: 60
models: []  # none yet
"""


def test_the_store_line_is_replaced_and_every_other_line_and_comment_is_kept():
    new = set_store(WRITTEN, "@/etc/llmgw/secrets/store-dsn")
    old_lines, new_lines = WRITTEN.splitlines(), new.splitlines()
    changed = [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]
    assert changed == [
        ("  store: /var/lib/llmgw/llmgw.db  # the old store", f"  store: {REF}  # the old store"),
    ]
    assert yaml.safe_load(new)["auth"] == {"enabled": True, "store": "@/etc/llmgw/secrets/store-dsn", "default_rpm": 60}


def test_an_auth_block_without_a_store_gets_one_indented_like_its_other_keys():
    text = "listen: ':8080'\nauth:\n    enabled: true  # four spaces here\nmodels: []\n"
    new = set_store(text, "@/d")
    assert new == "listen: ':8080'\nauth:\n    store: \"@/d\"\n    enabled: true  # four spaces here\nmodels: []\n"


def test_a_server_yaml_without_auth_gets_an_auth_block_at_its_end():
    assert set_store("# only this\nlisten: ':8080'", "@/d") == "# only this\nlisten: ':8080'\nauth:\n  store: \"@/d\"\n"
    assert set_store("listen: x\nauth: null  # none yet\n", "@/d") == 'listen: x\nauth:  # none yet\n  store: "@/d"\n'


def test_a_quoted_store_with_a_hash_inside_and_a_value_continued_on_the_next_line_are_replaced_whole():
    quoted = 'auth:\n  store: "/srv/a #b.db"  # note\n  enabled: true\n'
    assert set_store(quoted, "@/d") == 'auth:\n  store: "@/d"  # note\n  enabled: true\n'
    continued = "auth:\n  store: /srv/a\n    b.db\n  enabled: true\n"
    assert set_store(continued, "@/d") == 'auth:\n  store: "@/d"\n  enabled: true\n'


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("auth: {enabled: true, store: /var/lib/llmgw/llmgw.db}\n", "flow style"),
        ("{listen: ':8080', auth: {store: /x}}\n", "flow style"),
        ("base: &s /x\nauth:\n  store: *s\n", "does not edit as text"),
        ("auth:\n  store: &s /x\nother: *s\n", "does not edit as text"),
    ],
)
def test_yaml_the_text_edit_would_get_wrong_is_refused_saying_what_to_set_by_hand(text, said):
    with pytest.raises(InitError, match=said) as exc:
        set_store(text, "@/etc/llmgw/secrets/store-dsn")
    assert '"@/etc/llmgw/secrets/store-dsn"' in str(exc.value)


# ------------------------------------------------------------------ small pieces


def test_the_scram_verifier_passes_the_rfc_7677_exchange():
    salt = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    verifier = pg.scram_verifier("pencil", salt)
    head, keys = verifier.split("$", 1)[1].split("$")
    assert head == "4096:W22ZaJ0SNY7soEsUEjb6gQ==" and verifier.startswith("SCRAM-SHA-256$")
    stored, server = (base64.b64decode(k) for k in keys.split(":"))
    nonce = "rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
    auth = f"n=user,r=rOprNGfwEbeRWgbNEkqO,r={nonce},s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096,c=biws,r={nonce}".encode()
    proof = base64.b64decode("dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    # What the server does with the client's proof, holding only the verifier.
    client_key = bytes(a ^ b for a, b in zip(proof, hmac.new(stored, auth, "sha256").digest(), strict=True))
    assert hashlib.sha256(client_key).digest() == stored
    assert base64.b64encode(hmac.new(server, auth, "sha256").digest()).decode() == (
        "6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    )


def test_pg_lsclusters_lines_are_read_into_clusters_and_its_header_is_not_one():
    out = (
        "Ver Cluster Port Status Owner    Data directory              Log file\n"
        "15  main    5432 online postgres /var/lib/postgresql/15/main /var/log/postgresql/postgresql-15-main.log\n"
        "16  spare   5433 down   postgres /var/lib/postgresql/16/spare /var/log/postgresql/postgresql-16-spare.log\n"
    )
    assert pg.parse_lsclusters(out) == [
        pg.Cluster("15", "main", 5432, True),
        pg.Cluster("16", "spare", 5433, False),
    ]


def test_with_postgres_the_two_steps_come_after_server_yaml_and_the_rest_move_on():
    plain, with_pg = numbering(Options(admin="a@b.c")), numbering(Options(admin="a@b.c", postgres=True))
    assert plain["store"] == 5 and plain["model"] == 11 and "postgres" not in plain
    assert (with_pg["config"], with_pg["postgres"], with_pg["move"], with_pg["store"], with_pg["model"]) == (
        4,
        5,
        6,
        7,
        13,
    )


# ------------------------------------------------------------------ the machine


class System:
    """A machine's commands as init runs them. Debian: pg_lsclusters, apt-get, the cluster's unit; the RHEL
    family: dnf, unit files and PGDATA, initdb. psql's SQL goes to the real server, ALTER SYSTEM aside."""

    def __init__(self, root: Path, *, family: str = "debian", installed: bool = False, unit: str | None = None):
        self.root = root
        self.family = family
        self.calls: list[list[str]] = []
        self.altered: list[str] = []
        self.active: set[str] = set()
        self.users: set[str] = set()
        self.unit = unit or ("postgresql@15-main.service" if family == "debian" else "postgresql.service")
        self.env: dict[str, str] = {}
        self.installed = False
        release = "ID=debian\nVERSION_ID=12\n" if family == "debian" else 'ID="rocky"\nID_LIKE="rhel centos fedora"\n'
        (root / "etc").mkdir(parents=True, exist_ok=True)
        (root / "etc/os-release").write_text(release)
        if family == "rhel":
            (root / "usr/bin").mkdir(parents=True, exist_ok=True)
            (root / "usr/bin/dnf").write_text("")
        if installed:
            self._install()

    def _install(self) -> None:
        self.installed = True
        if self.family == "debian":
            self.active.add(self.unit)  # Debian's package makes the cluster and starts it
            return
        version = self.unit.removeprefix("postgresql-").removesuffix(".service").removeprefix("postgresql")
        data = f"/var/lib/pgsql/{version}/data" if version else "/var/lib/pgsql/data"
        units = self.root / "usr/lib/systemd/system"
        units.mkdir(parents=True, exist_ok=True)
        (units / self.unit).write_text(f"[Service]\nEnvironment=PGDATA={data}/\n")
        self.env[self.unit] = f"PGDATA={data}/ PG_OOM_ADJUST_FILE=/proc/self/oom_score_adj"

    def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(argv)
        if argv[:2] == ["id", "-u"]:
            return (0, "999") if argv[2] in self.users else (1, "no such user")
        if argv[0] == "useradd":
            self.users.add(argv[-1])
            return 0, ""
        if argv[0] == "pg_lsclusters":
            if self.family != "debian" or not self.installed:
                return 127, "pg_lsclusters is not installed"
            state = "online" if self.unit in self.active else "down"
            return 0, f"15  main    5432 {state} postgres /var/lib/postgresql/15/main /var/log/postgresql/15-main.log"
        if "install" in argv and ("apt-get" in argv or "dnf" in argv):
            self._install()
            return 0, "installed"
        if argv[:2] == ["systemctl", "show"]:
            return 0, self.env.get(argv[-1], "")
        if argv[:2] in (["systemctl", "enable"], ["systemctl", "start"], ["systemctl", "restart"]):
            self.active.add(argv[-1])
            return 0, ""
        if argv[:2] == ["systemctl", "stop"]:
            self.active.discard(argv[-1])
            return 0, ""
        if argv[:2] in (["systemctl", "is-enabled"], ["systemctl", "is-active"]):
            return (0, "") if argv[-1] in self.active else (3, "")
        if argv[0] == "runuser":
            prog, args = argv[argv.index("--") + 4], argv[argv.index("--") + 5 :]
            if prog.endswith("/initdb"):
                data = self.root / args[args.index("-D") + 1].lstrip("/")
                data.mkdir(parents=True, exist_ok=True)
                (data / "PG_VERSION").write_text("16\n")
                return 0, "Success."
            if not any(u.startswith("postgresql") for u in self.active):
                return 2, 'psql: error: connection to server on socket "/var/run/postgresql/.s.PGSQL.5432" failed'
            return self._sql(args)
        return 0, ""

    def _sql(self, args: list[str]) -> tuple[int, str]:
        db = args[args.index("-d") + 1]
        out = []
        for i, a in enumerate(args):
            if a != "-c":
                continue
            sql = args[i + 1]
            if sql.startswith("ALTER SYSTEM"):
                self.altered.append(sql)
                continue
            assert HOST_PSQL is not None
            p = subprocess.run(
                [HOST_PSQL, "-h", "127.0.0.1", "-U", "postgres", "-X", "-q", "-A", "-t", "-p", "5432", "-d", db]
                + ["-v", "ON_ERROR_STOP=1", "-c", sql],
                capture_output=True,
                text=True,
                check=False,
            )
            out.append(p.stdout + p.stderr)
            if p.returncode != 0:
                return p.returncode, "".join(out)
        return 0, "".join(out)

    def ran(self, word: str) -> list[list[str]]:
        return [c for c in self.calls if word in c]


@pytest.fixture
def pg_name():
    """A role and database name on the real server for one test, dropped afterwards."""
    if HOST_PSQL is None:
        pytest.skip("no psql here")
    try:
        asyncio.run(pg_exec(PG_ADMIN, "SELECT 1"))
    except (TimeoutError, OSError, asyncpg.PostgresError):
        pytest.skip("no PostgreSQL answered on 127.0.0.1:5432")
    name = f"llmgw_test_{secrets.token_hex(5)}"
    yield name
    asyncio.run(pg_exec(PG_ADMIN, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'DROP ROLE IF EXISTS "{name}"'))


def machine(root: Path, system: System, name: str = "llmgw", *, systemd: bool = True, **kw) -> Machine:
    if systemd:
        (root / "run/systemd/system").mkdir(parents=True, exist_ok=True)
    return Machine(
        root=root,
        run=system,
        names=["cp1", "localhost"],
        addresses=["127.0.0.1"],
        binary="/usr/local/bin/llmgw",
        health_timeout=0.5,
        pg_name=name,
        **{"health": lambda url: True, **kw},  # the gateway answers, unless a test says otherwise
    )


def run(m: Machine, **kw) -> tuple[list[str], Report]:
    lines: list[str] = []
    opts = Options(admin="admin@example.com", no_mirror=True, no_node=True, no_model=True, **kw)
    return lines, server_init(m, opts, emit=lines.append)


def step(lines: list[str], n: int) -> str:
    return next(line for line in lines if line.startswith(f"{n}. "))


def sqlite_control_plane(tmp_path: Path, system: System, name: str, **kw) -> tuple[Machine, str, str]:
    """A control plane on SQLite, as a plain init leaves it, with one API key; returns the machine, the
    administrator's password and the key's id."""
    m = machine(tmp_path, system, name, **kw)
    _, rep = run(m)
    assert rep.password
    m.config.write_text(m.config.read_text().replace("listen:", "# the operator's note\nlisten:", 1))

    async def key() -> str:
        async with await Store.open(str(m.var / "llmgw.db")) as s:
            _, rec = await s.create_key("ci-bot")
            return rec.id

    return m, rep.password, asyncio.run(key())


async def _tables(name: str) -> list[str]:
    conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}", timeout=3)
    try:
        return [r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
    finally:
        await conn.close()


# ------------------------------------------------------------------ refusals


def test_a_postgresql_store_init_did_not_set_up_is_refused_before_anything_is_installed(tmp_path):
    system = System(tmp_path)
    m = machine(tmp_path, system)
    run(m, store="postgres://app:secret@db.internal:5432/llmgw", stop_after=4)
    lines: list[str] = []
    with pytest.raises(InitError, match=r"already PostgreSQL at postgres://app:\*\*\*@db.internal:5432/llmgw") as exc:
        server_init(m, Options(admin="admin@example.com", postgres=True, no_mirror=True), emit=lines.append)
    assert "llmgw keys move-store" in str(exc.value) and "secret" not in str(exc.value)
    assert lines[-1].startswith("5. FAILED: PostgreSQL: the store is already PostgreSQL")
    assert not system.ran("apt-get") and not system.ran("runuser")


def test_a_dsn_file_naming_another_server_is_refused_as_postgresql_already(tmp_path):
    system = System(tmp_path)
    m = machine(tmp_path, system)
    run(m, store=pg.store_ref(m), stop_after=4)
    pg.dsn_path(m).parent.mkdir(parents=True)
    pg.dsn_path(m).write_text("postgresql://llmgw:pw@db.internal:5432/llmgw\n")
    with pytest.raises(InitError, match=r"already PostgreSQL at postgresql://llmgw:\*\*\*@db.internal"):
        run(m, postgres=True)
    assert not system.ran("apt-get")


def test_a_flow_style_auth_is_refused_before_postgresql_is_installed(tmp_path):
    system = System(tmp_path)
    m = machine(tmp_path, system)
    run(m, stop_after=4)
    data = yaml.safe_load(m.config.read_text())
    m.config.write_text("auth: " + yaml.safe_dump(data.pop("auth"), default_flow_style=True) + yaml.safe_dump(data))
    with pytest.raises(InitError, match="flow style"):
        run(m, postgres=True)
    assert not system.ran("apt-get")


def test_postgres_with_store_is_refused_and_so_is_postgres_under_root(tmp_path):
    with pytest.raises(InitError, match="--postgres sets up PostgreSQL on this machine and --store"):
        run(machine(tmp_path, System(tmp_path)), postgres=True, store="postgres://a@b/c")
    r = CliRunner().invoke(
        app, ["server", "init", "--admin", "a@example.com", "--postgres", "--root", str(tmp_path / "r")]
    )
    assert r.exit_code != 0 and "cannot be tried under --root" in r.output
    assert not (tmp_path / "r").exists()


def test_a_cluster_on_another_port_and_several_pgdg_versions_are_refused_as_not_handled(tmp_path):
    deb = System(tmp_path / "deb", installed=True)
    m = machine(tmp_path / "deb", deb)
    run(m, stop_after=4)
    deb_calls = deb.__call__

    def other_port(argv: list[str]) -> tuple[int, str]:
        if argv[0] == "pg_lsclusters":
            return 0, "16  main    5433 online postgres /var/lib/postgresql/16/main /var/log/x.log"
        return deb_calls(argv)

    m.run = other_port
    with pytest.raises(InitError, match="do not listen on port 5432.*not handled"):
        run(m, postgres=True)

    rhel = System(tmp_path / "rhel", family="rhel", installed=True, unit="postgresql-15.service")
    (tmp_path / "rhel/usr/lib/systemd/system/postgresql-16.service").write_text("[Service]\n")
    m = machine(tmp_path / "rhel", rhel)
    with pytest.raises(InitError, match=r"several PostgreSQL servers.*postgresql-15.service, postgresql-16.service"):
        run(m, postgres=True)
    assert not rhel.ran("runuser")


# ------------------------------------------------------------------ the steps, against a real server


def test_postgresql_absent_is_installed_tuned_and_the_sqlite_store_moved_with_its_keys_and_accounts(tmp_path, pg_name):
    system = System(tmp_path)
    m, password, key_id = sqlite_control_plane(tmp_path, system, pg_name)
    before = m.config.read_text()
    start = len(system.calls)
    lines, _ = run(m, postgres=True)

    assert system.ran("apt-get")[0][-4:] == ["install", "-y", "--no-install-recommends", "postgresql"]
    assert system.altered == ["ALTER SYSTEM SET shared_buffers = '96MB'", "ALTER SYSTEM SET max_connections = 40"]
    assert ["systemctl", "restart", "postgresql@15-main.service"] in system.calls
    five = step(lines, 5)
    assert "installed PostgreSQL 15 (cluster 15/main) with apt-get" in five
    assert "tuned it for sharing this machine (shared_buffers = 96MB, max_connections = 40" in five
    assert f"made the role {pg_name}, the database {pg_name}, {pg.dsn_path(m)}" in five
    # The DSN file: 0600, in a 0700 directory, never in the step lines.
    dsn = pg.dsn_path(m)
    assert oct(dsn.stat().st_mode & 0o777) == "0o600" and oct(dsn.parent.stat().st_mode & 0o777) == "0o700"
    secret = pg._read_dsn(dsn).password
    assert secret and len(secret) >= 24 and not any(secret in line for line in lines)
    assert dsn.read_text() == f"postgres://{pg_name}:{secret}@127.0.0.1:5432/{pg_name}\n"

    # server.yaml: one line changed, the comments kept, the previous file beside it.
    after = m.config.read_text()
    assert [b for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b] == [f'  store: "@{dsn}"']
    assert "# the operator's note" in after
    assert (m.etc / "server.yaml.before-postgres").read_text() == before
    six = step(lines, 6)
    assert "stopped llmgw-server.service" in six and "rows; the file is kept as it was, unused" in six
    assert "llmgw-server.service restarted on PostgreSQL" in six
    gateway = [c[1] for c in system.calls[start:] if c[0] == "systemctl" and c[-1] == "llmgw-server.service"]
    # Stopped for the copy and started on PostgreSQL by the move; found running by the unit step.
    assert gateway == ["is-active", "stop", "restart", "is-enabled", "is-active"]

    async def moved() -> tuple[bool, list[str]]:
        async with await Store.open(load_server_config(m.config).auth.store) as s:
            ok = await s.verify_password("admin@example.com", password) is not None
            return ok, [k.id for k in await s.list_keys()]

    assert asyncio.run(moved()) == (True, [key_id])
    assert (m.var / "llmgw.db").exists()  # the SQLite store is left as it was

    # A rerun changes nothing: no install, no tuning, no restart, every step kept.
    calls = len(system.calls)
    again, rep = run(m, postgres=True)
    assert "done: nothing changed." in again, again
    assert {d.status for d in rep.done} <= {"kept", "skipped"} and len(rep.done) == 13
    assert "its settings left alone" not in step(again, 5)  # still the server init installed
    new_calls = system.calls[calls:]
    assert not [c for c in new_calls if "apt-get" in c or c[:2] in (["systemctl", "restart"], ["systemctl", "stop"])]
    assert len(system.altered) == 2 and dsn.read_text().endswith(f":{secret}@127.0.0.1:5432/{pg_name}\n")


def test_a_postgresql_found_here_is_used_as_it_is_and_not_tuned(tmp_path, pg_name):
    system = System(tmp_path, installed=True)
    m = machine(tmp_path, system, pg_name)
    lines, _ = run(m, postgres=True)  # a first run: server.yaml names PostgreSQL from the start
    assert not system.ran("apt-get") and system.altered == []
    assert "found PostgreSQL 15 (cluster 15/main); its settings left alone (init did not install it)" in step(lines, 5)
    assert "server.yaml's store is PostgreSQL" in step(lines, 6)
    assert load_server_config(m.config).auth.store == pg.store_ref(m)
    assert not (m.etc / "server.yaml.before-postgres").exists() and not (m.var / "llmgw.db").exists()
    assert "api_keys" in asyncio.run(_tables(pg_name))  # the store's tables, made by the connection check


def test_a_role_init_did_not_make_is_refused_rather_than_given_a_new_password(tmp_path, pg_name):
    asyncio.run(pg_exec(PG_ADMIN, f"CREATE ROLE {pg_name} LOGIN"))
    system = System(tmp_path, installed=True)
    m = machine(tmp_path, system, pg_name)
    with pytest.raises(InitError, match=f"already has a role {pg_name} that init did not make"):
        run(m, postgres=True)
    assert not pg.dsn_path(m).exists()


def test_a_gateway_that_does_not_start_on_postgresql_puts_server_yaml_back_and_runs_on_sqlite_again(tmp_path, pg_name):
    system = System(tmp_path)
    asked: list[str] = []

    def health(url: str) -> bool:
        asked.append(load_server_config(m.config).auth.store)
        return not asked[-1].startswith("@")  # answers on SQLite only

    m, _, _ = sqlite_control_plane(tmp_path, system, pg_name)
    before = m.config.read_text()
    m.health = health
    lines: list[str] = []
    with pytest.raises(InitError) as exc:
        server_init(
            m,
            Options(admin="admin@example.com", postgres=True, no_mirror=True, no_node=True, no_model=True),
            emit=lines.append,
        )
    said = str(exc.value)
    assert said.startswith("the gateway did not start on PostgreSQL: llmgw-server.service started but")
    assert "server.yaml is back as it was" in said and "the gateway runs on SQLite again" in said
    assert "the copy in PostgreSQL was removed again" in said
    assert lines[-1].startswith("6. FAILED: store to PostgreSQL: the gateway did not start on PostgreSQL")
    assert m.config.read_text() == before and asked[-1] == str(m.var / "llmgw.db")
    assert system.calls[-1] == ["systemctl", "restart", "llmgw-server.service"]
    assert asyncio.run(_tables(pg_name)) == []

    # Fixed (here: it answers on PostgreSQL too), a rerun moves the store into the emptied database.
    m.health = lambda url: True
    lines, _ = run(m, postgres=True)
    assert "moved the store" in step(lines, 6)
    assert load_server_config(m.config).auth.store == pg.store_ref(m)


def test_a_move_refused_because_the_sqlite_store_is_in_use_changes_nothing_and_restarts_the_gateway(tmp_path, pg_name):
    system = System(tmp_path)
    m, _, _ = sqlite_control_plane(tmp_path, system, pg_name)
    before = m.config.read_text()
    db = m.var / "llmgw.db"
    # Another process with the store open (a backup script, an sqlite3 shell): move-store refuses to copy it.
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sqlite3, sys; c = sqlite3.connect({str(db)!r}); "
         "c.execute('SELECT count(*) FROM sqlite_master').fetchall(); print('open', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(
            InitError,
            match=rf"moving the store {db} to PostgreSQL failed \(llmgw-server.service stopped for it\): .*pid {holder.pid}",
        ) as exc:
            run(m, postgres=True)
    finally:
        holder.communicate("")
    assert "server.yaml was not changed and the gateway runs on SQLite again" in str(exc.value)
    assert m.config.read_text() == before and not (m.etc / "server.yaml.before-postgres").exists()
    assert system.calls[-1] == ["systemctl", "restart", "llmgw-server.service"]


def test_on_the_rhel_family_a_pgdg_server_is_found_by_its_unit_initialised_with_password_logins_and_started(
    tmp_path, pg_name
):
    system = System(tmp_path, family="rhel", installed=True, unit="postgresql-16.service")
    m = machine(tmp_path, system, pg_name)
    lines, _ = run(m, postgres=True)
    (initdb,) = [c for c in system.ran("runuser") if c[7].endswith("initdb")]
    assert initdb[7:] == [
        "/usr/pgsql-16/bin/initdb",
        "-D",
        "/var/lib/pgsql/16/data",
        "--auth-local=peer",
        "--auth-host=scram-sha-256",
        "--encoding=UTF8",
    ]
    assert ["systemctl", "enable", "--now", "postgresql-16.service"] in system.calls
    assert all(c[7] == "/usr/pgsql-16/bin/psql" for c in system.ran("runuser") if c is not initdb)
    five = step(lines, 5)
    assert "found PostgreSQL 16 (postgresql-16.service); initialised /var/lib/pgsql/16/data" in five
    assert "its settings left alone" in five and system.altered == []


def test_on_the_rhel_family_postgresql_absent_is_installed_with_dnf_initialised_and_tuned(tmp_path, pg_name):
    system = System(tmp_path, family="rhel")
    m = machine(tmp_path, system, pg_name)
    lines, _ = run(m, postgres=True)
    assert system.ran("dnf") == [["dnf", "install", "-y", "postgresql-server"]]
    assert any(c[7] == "/usr/bin/initdb" and "/var/lib/pgsql/data" in c for c in system.ran("runuser"))
    assert len(system.altered) == 2 and ["systemctl", "restart", "postgresql.service"] in system.calls
    assert "installed PostgreSQL (postgresql.service) with dnf" in step(lines, 5)
