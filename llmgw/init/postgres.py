"""`server init --postgres`: the store on a PostgreSQL server on this machine.

The step "PostgreSQL" finds the server (Debian's clusters through `pg_lsclusters`; on the RHEL family
the systemd unit, PGDG's `postgresql-NN.service` with its tools in `/usr/pgsql-NN/bin`, PGDATA read
from the unit), installs it with the machine's package manager when there is none (on the RHEL family
`initdb` with password logins over TCP, whose default is ident), starts it, tunes it for sharing the
machine only when init installed it, makes the role and database with a generated password kept in
`/etc/llmgw/secrets/store-dsn`, and connects with it.

The step "store to PostgreSQL" stops the gateway, copies the SQLite store into that database
(:func:`llmgw.store.move.move_store`), points `auth.store` at the DSN file by editing server.yaml's
text (the previous file kept beside it) and starts the gateway again, waiting for /health. When
anything after the stop fails, the previous server.yaml goes back and the gateway starts on SQLite,
which the copy never changed.

Not handled (said, not guessed at): ident logins over TCP, a server on another port than 5432,
several PGDG versions installed side by side.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml
from sqlalchemy import text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import create_async_engine

from llmgw.agent.discovery.host import os_family, parse_os_release
from llmgw.config import ConfigError, ServerConfig, load_server_config, parse_server_config
from llmgw.files import write_atomic
from llmgw.init import InitError
from llmgw.init.machine import Machine
from llmgw.init.steps import Done, _host, _must, await_health
from llmgw.init.units import SERVER_UNIT
from llmgw.init.yamltext import set_store
from llmgw.store import Store
from llmgw.store.address import resolve_store_address
from llmgw.store.errors import StoreError, mask_password
from llmgw.store.move import VERSION_TABLE, MoveResult, move_store
from llmgw.store.schema import metadata

DSN_FILE = "/etc/llmgw/secrets/store-dsn"
HOST = "127.0.0.1"
PORT = 5432
# Co-located with the gateway (and a node): a small server. Applied only to a PostgreSQL init installed.
TUNING = (("shared_buffers", "'96MB'"), ("max_connections", "40"))
TUNING_SHOWN = "shared_buffers = 96MB, max_connections = 40"
BACKUP_NAME = "server.yaml.before-postgres"
# Written when init installs PostgreSQL, so a rerun knows whose server it is (and finishes the tuning).
MARKER_NAME = "postgres-installed"
TUNED = "tuned:"
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_POSTGRES_SCHEMES = {"postgres", "postgresql", "postgresql+asyncpg"}
_PGDG_UNIT = re.compile(r"postgresql(?:-(\d+))?\.service")
NOT_HANDLED = (
    "set it up by hand: make a role and database there, stop the gateway, `llmgw keys move-store --to DSN`, "
    "and point auth.store at it"
)


def dsn_path(m: Machine) -> Path:
    return m.path(DSN_FILE)


def store_ref(m: Machine) -> str:
    """What auth.store says once the store is on PostgreSQL: the DSN file, read by whoever opens the store."""
    return "@" + str(dsn_path(m))


def marker_path(m: Machine) -> Path:
    return m.etc / MARKER_NAME


# ------------------------------------------------------------------ what is there


@dataclass(frozen=True)
class Server:
    """A PostgreSQL server found here."""

    family: str  # "debian" or "rhel"
    version: str  # "15"; "" when the unit does not say (the RHEL family's own postgresql.service)
    unit: str  # the systemd unit that runs it
    bindir: str  # where its psql (and initdb) are
    running: bool
    pgdata: str | None = None  # the RHEL family: the data directory the unit names
    cluster: str | None = None  # Debian: the cluster's name (main)

    @property
    def shown(self) -> str:
        v = f"PostgreSQL {self.version}" if self.version else "PostgreSQL"
        return f"{v} (cluster {self.version}/{self.cluster})" if self.cluster else f"{v} ({self.unit})"


def family(m: Machine) -> str | None:
    """debian or rhel (the families init can install PostgreSQL on), from os-release; None otherwise."""
    try:
        info = parse_os_release(m.path("/etc/os-release").read_text(encoding="utf-8"))
    except OSError:
        info = {}
    fam = os_family(info.get("ID"), info.get("ID_LIKE", "").split())
    if fam is None:
        if m.path("/etc/debian_version").exists():
            fam = "debian"
        elif m.path("/etc/redhat-release").exists():
            fam = "rhel"
    return fam if fam in ("debian", "rhel") else None


@dataclass(frozen=True)
class Cluster:
    version: str
    name: str
    port: int
    online: bool


def parse_lsclusters(out: str) -> list[Cluster]:
    """`pg_lsclusters --no-header`: version, cluster, port, status, owner, data directory, log file."""
    found = []
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and re.fullmatch(r"\d+(\.\d+)?", f[0]) and f[2].isdigit():
            found.append(Cluster(f[0], f[1], int(f[2]), f[3].startswith("online")))
    return found


def _find_debian(m: Machine) -> Server | None:
    rc, out = m.run(["pg_lsclusters", "--no-header"])
    if rc == 127:
        return None  # no postgresql-common: no server from Debian's packages
    if rc != 0:
        raise InitError(f"pg_lsclusters failed: {out or f'exit status {rc}'}")
    clusters = parse_lsclusters(out)
    if not clusters:
        servers = sorted(p.parts[-3] for p in m.path("/usr/lib/postgresql").glob("*/bin/postgres"))
        if servers:
            raise InitError(
                f"PostgreSQL {', '.join(servers)} is installed but has no cluster; make one on port {PORT} "
                f"(`pg_createcluster --start {servers[-1]} main`) and run init again"
            )
        return None
    here = [c for c in clusters if c.port == PORT]
    if not here:
        ports = ", ".join(f"{c.version}/{c.name} on {c.port}" for c in clusters)
        raise InitError(
            f"PostgreSQL's clusters here ({ports}) do not listen on port {PORT}, the only one init sets up the "
            f"store on (another port is not handled); {NOT_HANDLED}"
        )
    c = here[0]
    unit, bindir = f"postgresql@{c.version}-{c.name}.service", f"/usr/lib/postgresql/{c.version}/bin"
    return Server("debian", c.version, unit, bindir, c.online, cluster=c.name)


def _pgdata(m: Machine, unit: str, unit_file: Path, version: str) -> str:
    """PGDATA as the unit sets it: systemd's view (drop-ins included), else the unit file, else the default."""
    rc, out = m.run(["systemctl", "show", "--property=Environment", "--value", unit])
    words = out.split() if rc == 0 else []
    if not words:
        try:
            words = [
                w
                for line in unit_file.read_text(encoding="utf-8").splitlines()
                if line.strip().startswith("Environment=")
                for w in line.strip()[len("Environment=") :].replace('"', " ").split()
            ]
        except OSError:
            words = []
    for w in words:
        if w.startswith("PGDATA="):
            return w[len("PGDATA=") :].rstrip("/") or "/"
    return f"/var/lib/pgsql/{version}/data" if version else "/var/lib/pgsql/data"


def _find_rhel(m: Machine) -> Server | None:
    files: dict[str, Path] = {}
    for d in ("/usr/lib/systemd/system", "/etc/systemd/system"):
        for p in sorted(m.path(d).glob("postgresql*.service")):
            if _PGDG_UNIT.fullmatch(p.name):
                files.setdefault(p.name, p)
    if not files:
        return None
    if len(files) > 1:
        raise InitError(
            f"several PostgreSQL servers are installed here ({', '.join(sorted(files))}); init does not choose "
            f"among them (not handled); {NOT_HANDLED}"
        )
    unit, path = next(iter(files.items()))
    match = _PGDG_UNIT.fullmatch(unit)
    version = (match.group(1) or "") if match else ""
    bindir = f"/usr/pgsql-{version}/bin" if version else "/usr/bin"  # PGDG's layout, or the distribution's
    running = m.run(["systemctl", "is-active", "--quiet", unit])[0] == 0
    return Server("rhel", version, unit, bindir, running, pgdata=_pgdata(m, unit, path, version))


def find(m: Machine, fam: str) -> Server | None:
    return _find_debian(m) if fam == "debian" else _find_rhel(m)


# ------------------------------------------------------------------ acting on it


def _tail(out: str, n: int = 6) -> str:
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-n:]) if lines else "no output"


def install(m: Machine, fam: str) -> tuple[str, str]:
    """PostgreSQL from the machine's package sources; returns the tool and the command it ran."""
    if fam == "debian":
        tool, argv = "apt-get", ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"]
        env = ["env", "DEBIAN_FRONTEND=noninteractive"]
        rc, out = m.run_long(env + argv)
        if rc != 0:
            # A fresh image often has no package lists (or stale ones): once more after fetching them.
            m.run_long(["apt-get", "update"])
            rc, out = m.run_long(env + argv)
    else:
        tool = "dnf" if m.path("/usr/bin/dnf").exists() else "yum"
        argv = [tool, "install", "-y", "postgresql-server"]
        rc, out = m.run_long(argv)
    if rc != 0:
        raise InitError(f"installing PostgreSQL failed ({' '.join(argv)}): {_tail(out)}")
    return tool, " ".join(argv)


def psql(m: Machine, srv: Server, *sql: str, db: str = "postgres") -> str:
    """Statements run by psql as postgres over the local socket (peer login), one transaction each."""
    argv = ["runuser", "-u", "postgres", "--", "env", "-C", "/", f"{srv.bindir}/psql"]
    argv += ["-X", "-q", "-A", "-t", "-p", str(PORT), "-d", db, "-v", "ON_ERROR_STOP=1"]
    for s in sql:
        argv += ["-c", s]
    rc, out = m.run(argv)
    if rc != 0:
        raise InitError(f"psql as postgres failed on {sql[0].split(' PASSWORD ')[0]!r}: {_tail(out)}")
    return out


def _answer(out: str, tag: str) -> str | None:
    """The value of the line `tag=value` a query printed (psql's other lines, if any, are not it)."""
    m = re.search(rf"^{re.escape(tag)}=(.*)$", out, re.MULTILINE)
    return m.group(1).strip() if m else None


def _wait_ready(m: Machine, srv: Server) -> None:
    deadline = time.monotonic() + m.health_timeout
    while True:
        try:
            if _answer(psql(m, srv, "SELECT 'ready=' || 1"), "ready") == "1":
                return
            last = "no answer"
        except InitError as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise InitError(
                f"{srv.shown} did not answer on port {PORT} within {m.health_timeout:g} s ({last}); see "
                f"`journalctl -u {srv.unit}`. init sets up the store only on a server on port {PORT}"
            )
        time.sleep(0.5)


def _initdb(m: Machine, srv: Server) -> bool:
    """The RHEL family ships an empty PGDATA: initdb as postgres, with password logins over TCP."""
    if srv.pgdata is None or (m.path(srv.pgdata) / "PG_VERSION").exists():
        return False
    argv = ["runuser", "-u", "postgres", "--", "env", "-C", "/", f"{srv.bindir}/initdb", "-D", srv.pgdata]
    argv += ["--auth-local=peer", "--auth-host=scram-sha-256", "--encoding=UTF8"]
    _must(m, argv, f"initialising {srv.pgdata}")
    return True


def _start(m: Machine, srv: Server) -> None:
    if not m.systemd:
        raise InitError(
            f"{srv.shown} is not running, and systemd is not running here to start it; start it and run init again"
        )
    # Debian enables its clusters itself; the RHEL family's unit starts disabled.
    argv = ["systemctl", "start", srv.unit] if srv.family == "debian" else ["systemctl", "enable", "--now", srv.unit]
    _must(m, argv, f"starting {srv.unit}")


def _tune(m: Machine, srv: Server) -> None:
    psql(m, srv, *(f"ALTER SYSTEM SET {name} = {value}" for name, value in TUNING))
    _must(m, ["systemctl", "restart", srv.unit], f"restarting {srv.unit} with the new settings")


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = 4096) -> str:
    """What PostgreSQL stores for a SCRAM-SHA-256 password (RFC 5802, 7677), so that CREATE ROLE is given
    this and never the password itself, which would show in psql's argument list."""
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    stored = hashlib.sha256(hmac.new(salted, b"Client Key", "sha256").digest()).digest()
    server = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode("ascii")

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored)}:{b64(server)}"


def dsn_for(name: str, password: str) -> str:
    return f"postgres://{name}:{password}@{HOST}:{PORT}/{name}"


def _read_dsn(path: Path) -> URL | None:
    """The DSN file's address as a URL; None when it is not a PostgreSQL one."""
    content = path.read_text(encoding="utf-8").strip()
    m = _SCHEME.match(content)
    if m is None or m.group(1).lower() not in _POSTGRES_SCHEMES:
        return None
    try:
        return make_url("postgresql://" + content[m.end() :])
    except ArgumentError:
        return None


def _is_ours(url: URL | None, name: str) -> bool:
    return (
        url is not None
        and url.username == name
        and url.database == name
        and url.host in (HOST, "localhost")
        and (url.port or PORT) == PORT
        and bool(url.password)
    )


def _shown(url: URL) -> str:
    return mask_password(url.render_as_string(hide_password=False))


def _role_and_database(m: Machine, srv: Server) -> list[str]:
    """The role and database (made when missing) and the DSN file; returns what was made."""
    name = m.pg_name
    assert _NAME.fullmatch(name), name  # an identifier needing no quoting
    dsn = dsn_path(m)
    role = _answer(psql(m, srv, f"SELECT 'role=' || count(*) FROM pg_roles WHERE rolname = '{name}'"), "role") == "1"
    wrote = False
    if dsn.exists():
        url = _read_dsn(dsn)
        if url is None or not _is_ours(url, name):
            raise InitError(
                f"{dsn} does not hold the address init writes ({dsn_for(name, '***')}); move it away and run init again"
            )
        password = str(url.password)
    elif role:
        # The DSN file is written before the role is made, so a role without it is someone else's.
        raise InitError(
            f"PostgreSQL already has a role {name} that init did not make ({dsn} is missing): drop it "
            f"(`runuser -u postgres -- psql -c 'DROP ROLE {name}'`, if nothing uses it), or write its DSN "
            f"({dsn_for(name, 'PASSWORD')}) to {dsn}, and run init again"
        )
    else:
        password = secrets.token_urlsafe(24)  # URL-safe: it goes into the DSN as it is
        dsn.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        dsn.parent.chmod(0o700)
        write_atomic(dsn, (dsn_for(name, password) + "\n").encode("utf-8"), 0o600)
        wrote = True
    m.give(dsn.parent)
    m.give(dsn)  # the gateway runs as llmgw and reads it
    if not role:
        psql(m, srv, f"CREATE ROLE {name} LOGIN PASSWORD '{scram_verifier(password)}'")
    query = f"SELECT 'owner=' || pg_get_userbyid(datdba) FROM pg_database WHERE datname = '{name}'"
    owner = _answer(psql(m, srv, query), "owner")
    if owner is None:
        query = "SELECT 'enc=' || pg_encoding_to_char(encoding) FROM pg_database WHERE datname = 'template1'"
        # A cluster made in the C locale (no LANG when it was installed) gives SQL_ASCII; the store is UTF-8.
        utf8 = _answer(psql(m, srv, query), "enc") == "UTF8"
        extra = "" if utf8 else " ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
        psql(m, srv, f"CREATE DATABASE {name} OWNER {name}{extra}")
    elif owner != name:
        raise InitError(
            f"PostgreSQL already has a database {name} owned by {owner}, not by the role {name}; init keeps it. "
            f"Drop it if nothing uses it, or {NOT_HANDLED}"
        )
    made = [f"the role {name}"] if not role else []
    made += [f"the database {name}"] if owner is None else []
    made += [f"{dsn} (mode 0600, owned by llmgw)"] if wrote else []
    return made


def check_connects(address: str) -> None:
    """A real connection, as the gateway will make it; it also migrates the (empty) database to this
    llmgw's schema, which proves the role may create its tables."""

    async def go() -> None:
        store = await Store.open(address)
        await store.close()

    try:
        asyncio.run(go())
    except StoreError as exc:
        raise InitError(
            f"connecting with {address[1:] if address.startswith('@') else address} failed: {exc} PostgreSQL "
            f"must accept password logins (scram-sha-256 or md5 in pg_hba.conf) from {HOST} on port {PORT}; "
            "ident logins over TCP are not handled"
        ) from None


# ------------------------------------------------------------------ what server.yaml says


def _sqlite_store(addr: str) -> str | None:
    """The SQLite file a store address names, or None when it names something else."""
    if _SCHEME.match(addr) is None:
        return addr
    scheme = addr.split(":", 1)[0].lower()
    if scheme in ("sqlite", "sqlite+aiosqlite"):
        try:
            return make_url(addr).database
        except ArgumentError:
            return None
    return None


def check_store(m: Machine, cfg: ServerConfig) -> str | None:
    """Before anything is installed: the SQLite file to move (None when server.yaml already names the
    store this sets up: a rerun). Refuses another PostgreSQL store, and a server.yaml that cannot be
    edited as text."""
    addr = cfg.auth.store.strip()
    ref = store_ref(m)
    if addr == ref:
        url = _read_dsn(dsn_path(m)) if dsn_path(m).exists() else None
        if dsn_path(m).exists() and not _is_ours(url, m.pg_name):
            raise _already(_shown(url) if url is not None else f"the address in {dsn_path(m)}")
        return None
    target = addr
    if addr.startswith("@"):
        try:
            target = Path(addr[1:].strip()).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise InitError(
                f"server.yaml's store {addr} cannot be read ({exc.strerror or exc}); fix it and run init again"
            ) from None
    sqlite = _sqlite_store(target)
    if sqlite is None:
        scheme = target.split(":", 1)[0].lower()
        if scheme in _POSTGRES_SCHEMES:
            raise _already(mask_password(target))
        raise InitError(
            f"server.yaml's store {mask_password(target)} is neither SQLite nor PostgreSQL; fix it and run init again"
        )
    try:
        new = parse_server_config(yaml.safe_load(set_store(m.config.read_text(encoding="utf-8"), ref)) or {})
    except ConfigError as exc:
        raise InitError(f"server.yaml with auth.store set to {ref} does not load: {exc}") from None
    if new.data_path != cfg.data_path:
        raise InitError(
            f"server.yaml sets no data_dir, so the gateway keeps its files beside the SQLite store "
            f"({cfg.data_path}); on PostgreSQL they would be looked for in {new.data_path}. Add "
            f"`data_dir: {cfg.data_path}` to server.yaml and run init again"
        )
    return sqlite


def _already(shown: str) -> InitError:
    return InitError(
        f"the store is already PostgreSQL at {shown}; to move between PostgreSQL servers use "
        "`llmgw keys move-store` (with the gateway stopped), then point auth.store at the new one"
    )


# ------------------------------------------------------------------ the steps


def postgres(m: Machine, cfg: ServerConfig) -> Done:
    """PostgreSQL here, running, with the role, database and DSN file, and a connection that works."""
    check_store(m, cfg)  # refused before anything is installed
    fam = family(m)
    if fam is None:
        raise InitError(
            "init installs PostgreSQL only on Debian, Ubuntu and the RHEL family (os-release says otherwise); "
            f"install it yourself, or {NOT_HANDLED}"
        )
    did: list[str] = []
    changed = False
    srv = find(m, fam)
    marker = marker_path(m)
    installed = srv is None
    if srv is None:
        tool, how = install(m, fam)
        stamp = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
        note = f"PostgreSQL installed by `llmgw server init --postgres` ({how}) on {stamp}\n"
        write_atomic(marker, note.encode("utf-8"), 0o644)
        srv = find(m, fam)
        if srv is None:
            raise InitError(f"`{how}` finished but no PostgreSQL server is found here; run init again once it is")
        did.append(f"installed {srv.shown} with {tool}")
    else:
        did.append(f"found {srv.shown}")
    if fam == "rhel" and _initdb(m, srv):
        did.append(f"initialised {srv.pgdata} (password logins over TCP)")
        changed = True
    if not srv.running:
        _start(m, srv)
        did.append(f"started {srv.unit}")
        changed = True
    _wait_ready(m, srv)
    if not marker.exists():
        did.append("its settings left alone (init did not install it)")
    elif TUNED in marker.read_text(encoding="utf-8"):
        did[0] += f", which init installed and tuned ({marker})"
    else:
        _tune(m, srv)
        _wait_ready(m, srv)
        with marker.open("a", encoding="utf-8") as f:
            f.write(f"{TUNED} {TUNING_SHOWN}\n")
        did.append(f"tuned it for sharing this machine ({TUNING_SHOWN}; restarted)")
        changed = True
    made = _role_and_database(m, srv)
    if made:
        did.append("made " + ", ".join(made))
    check_connects(store_ref(m))
    did.append(f"{m.pg_name}@{HOST}:{PORT}/{m.pg_name} connects")
    status = "made" if installed or made else "changed" if changed else "kept"
    return Done("PostgreSQL", status, "; ".join(did))


def _move(m: Machine, sqlite: str, ref: str) -> MoveResult:
    async def go() -> MoveResult:
        # move-store copies only a store at this llmgw's schema: bring it there first (the gateway is stopped).
        store = await Store.open(sqlite)
        await store.close()
        return await move_store(sqlite, ref)

    try:
        return asyncio.run(go())
    except StoreError as exc:
        raise InitError(str(exc).rstrip(".")) from None
    finally:
        db = Path(sqlite)
        for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            if p.exists():
                m.give(p)  # made by root just now: the gateway, as llmgw, must still write them


def _empty_copy(ref: str) -> str:
    """Drop the tables the move made, so a rerun copies into an empty database again."""

    async def go() -> None:
        engine = create_async_engine(resolve_store_address(ref))
        try:
            async with engine.begin() as conn:
                await conn.execute(text("SET LOCAL lock_timeout = '10s'"))
                for t in [VERSION_TABLE, *(t.name for t in reversed(metadata.sorted_tables))]:
                    await conn.execute(text(f'DROP TABLE IF EXISTS "{t}" CASCADE'))
        finally:
            await engine.dispose()

    try:
        asyncio.run(go())
    except Exception as exc:  # the failure being reported matters more; this one is said beside it
        return f"; the copy in PostgreSQL could not be removed ({mask_password(str(exc)).splitlines()[0]}): drop its tables before running init again"
    return "; the copy in PostgreSQL was removed again"


def _back_on_sqlite(m: Machine, url: str, unit_here: bool, was_active: bool) -> str:
    """The gateway as it was before: running on SQLite when it was, stopped when it was not."""
    if not unit_here:
        return "the gateway was not running"
    if not was_active:
        m.run(["systemctl", "stop", SERVER_UNIT])
        return f"{SERVER_UNIT} is stopped, as it was"
    # Restart=on-failure may have run into systemd's start limit while it failed; that would refuse this start.
    m.run(["systemctl", "reset-failed", SERVER_UNIT])
    try:
        _must(m, ["systemctl", "restart", SERVER_UNIT], f"restarting {SERVER_UNIT}")
        await_health(m, url)
    except InitError as exc:
        return f"the gateway did not start on SQLite either: {exc}"
    return "the gateway runs on SQLite again"


def store_to_postgres(m: Machine, cfg: ServerConfig) -> tuple[Done, ServerConfig]:
    """The SQLite store moved into PostgreSQL and auth.store pointed at the DSN file; kept when it is."""
    ref = store_ref(m)
    title = "store to PostgreSQL"
    sqlite = check_store(m, cfg)
    if sqlite is None:
        return Done(title, "kept", f"server.yaml's store is PostgreSQL ({ref})"), cfg
    old = m.config.read_text(encoding="utf-8")
    new = set_store(old, ref)
    mode = m.config.stat().st_mode & 0o777
    url = f"http://{_host(cfg.admin_listen.connect_host)}:{cfg.admin_listen.port}/health"
    unit_here = m.systemd and (m.units / SERVER_UNIT).exists()
    was_active = unit_here and m.run(["systemctl", "is-active", "--quiet", SERVER_UNIT])[0] == 0
    did: list[str] = []
    if was_active:
        # move-store refuses a store in use: rows written during the copy would be lost.
        _must(m, ["systemctl", "stop", SERVER_UNIT], f"stopping {SERVER_UNIT}")
        did.append(f"stopped {SERVER_UNIT}")
    moved: MoveResult | None = None
    if Path(sqlite).exists():
        try:
            moved = _move(m, sqlite, ref)
        except InitError as exc:
            back = _back_on_sqlite(m, url, unit_here, was_active)
            stopped = f" ({SERVER_UNIT} stopped for it)" if was_active else ""
            raise InitError(
                f"moving the store {sqlite} to PostgreSQL failed{stopped}: {exc}; server.yaml was not changed and {back}"
            ) from None
        did.append(
            f"moved the store {sqlite} into PostgreSQL ({moved.rows:,} rows; the file is kept as it was, unused)"
        )
    else:
        did.append(f"no SQLite store at {sqlite} to move")
    backup = _backup(m, old)
    write_atomic(m.config, new.encode("utf-8"), mode)
    did.append(f"auth.store in {m.config} is {ref} (the previous file is {backup})")
    try:
        cfg = load_server_config(m.config)
        if unit_here:
            _must(m, ["systemctl", "restart", SERVER_UNIT], f"starting {SERVER_UNIT} on PostgreSQL")
            await_health(m, url)
            did.append(f"{SERVER_UNIT} {'re' if was_active else ''}started on PostgreSQL and {url} answers")
    except (InitError, ConfigError) as exc:
        write_atomic(m.config, old.encode("utf-8"), mode)
        back = _back_on_sqlite(m, url, unit_here, was_active)
        emptied = _empty_copy(ref) if moved is not None else ""
        kept = f" (the SQLite store {sqlite} was never changed)" if moved is not None else ""
        raise InitError(
            f"the gateway did not start on PostgreSQL: {exc}. server.yaml is back as it was{kept} and {back}{emptied}"
        ) from None
    return Done(title, "changed", "; ".join(did)), cfg


def _backup(m: Machine, old: str) -> Path:
    """server.yaml as it was, beside it; an earlier backup that differs is kept under a numbered name."""
    path = m.config.with_name(BACKUP_NAME)
    n = 1
    while path.exists() and path.read_text(encoding="utf-8") != old:
        n += 1
        path = m.config.with_name(f"{BACKUP_NAME}.{n}")
    if not path.exists():
        write_atomic(path, old.encode("utf-8"), m.config.stat().st_mode & 0o777)
    return path
