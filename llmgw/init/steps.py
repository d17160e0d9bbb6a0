"""The steps of `server init`, in the spec's order. Each looks before it acts and says what it did.

Nothing here overwrites the authority, server.yaml or an account's password;
the server certificate is reissued only to add names (keeping the old ones) or
to renew one near its end.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmgw.config import ConfigError, ServerConfig, load_server_config
from llmgw.config.server import ADMIN_TOKEN_FILE
from llmgw.files import write_atomic
from llmgw.init import InitError
from llmgw.init.machine import USER, Machine
from llmgw.init.plan import MirrorPlan
from llmgw.init.units import SERVER_UNIT, server_unit_text
from llmgw.pki import (
    CA_CERT,
    CA_KEY,
    PKIError,
    init_ca,
    issue_server,
    load_ca,
    load_cert,
    load_pair,
    near_end,
    san_names,
    verify_issued_by,
)
from llmgw.store import Store
from llmgw.store.admin_tokens import ensure_token_file
from llmgw.store.errors import StoreError
from llmgw.units import write_unit

DEFAULT = "default"  # the organization, team and project every control plane starts with


@dataclass(frozen=True)
class Done:
    """What a step did: ``status`` is made, kept, changed or skipped; ``detail`` the one line shown."""

    step: str
    status: str
    detail: str

    @property
    def line(self) -> str:
        return f"{self.step}: {self.detail}"


# ------------------------------------------------------------------ 1. user and directories


def user_and_directories(m: Machine, *, manage_user: bool = True) -> Done:
    """The system user llmgw (useradd only when `id` does not know it), /etc/llmgw, its pki/ and /var/lib/llmgw."""
    made: list[str] = []
    if not manage_user:
        user_note = f"the user {USER} left alone (not root)"
    elif m.run(["id", "-u", USER])[0] == 0:
        user_note = f"the user {USER} exists"
    else:
        rc, out = m.run(
            [
                "useradd",
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                "/var/lib/llmgw",
                "--shell",
                "/usr/sbin/nologin",
                USER,
            ]
        )
        if rc != 0:
            raise InitError(f"creating the system user {USER} failed (useradd): {out or f'exit status {rc}'}")
        made.append(f"the system user {USER}")
        user_note = ""
    for d, mode in ((m.etc, 0o755), (m.pki, 0o700), (m.var, 0o750)):
        if d.is_dir():
            continue
        if d.exists():
            raise InitError(f"{d} exists and is not a directory; move it away and run init again")
        d.mkdir(parents=True, mode=mode)
        d.chmod(mode)  # whatever the umask
        made.append(str(d))
    m.give(m.var)  # the server writes its store and tokens there
    kept = "; ".join(x for x in (user_note, "the directories exist" if not made else "") if x)
    if made:
        return Done("user and directories", "made", "made " + ", ".join(made) + (f"; {kept}" if kept else ""))
    return Done("user and directories", "kept", kept)


# ------------------------------------------------------------------ 2. the authority


def _foreign_certs(m: Machine) -> bool:
    """Certificates in /etc/llmgw with no authority in pki/: the authority is kept on another machine."""
    return (m.etc / "server.pem").exists() and not (m.pki / CA_CERT).exists() and not (m.pki / CA_KEY).exists()


def authority(m: Machine) -> Done:
    """The cluster's CA in pki/ (ca.pem, ca-key.pem): made when neither file is there, never overwritten."""
    cert, key = m.pki / CA_CERT, m.pki / CA_KEY
    if cert.exists() and key.exists():
        try:
            load_ca(m.pki)
        except PKIError as exc:
            raise InitError(f"the authority in {m.pki} does not load: {exc}; restore it from its backup") from None
        return Done("authority", "kept", f"kept the authority in {m.pki} (never replaced)")
    if cert.exists() or key.exists():
        have, lack = (cert, key) if cert.exists() else (key, cert)
        raise InitError(
            f"{have} is there but {lack.name} is not: half an authority. Restore {lack.name} from its backup, "
            f"or, if this machine never issued a certificate anyone uses, move {have} away and run init again"
        )
    if _foreign_certs(m):
        return Done(
            "authority",
            "kept",
            f"kept the certificates in {m.etc}: their authority is on another machine, so none is made here",
        )
    init_ca(m.pki, name="llmgw cluster CA")
    return Done("authority", "made", f"made the authority {cert} and {key} (back up {key.name})")


# ------------------------------------------------------------------ 3. the server certificate


def wanted_names(m: Machine, hosts: Sequence[str]) -> list[str]:
    return list(dict.fromkeys([*m.names, *m.addresses, *hosts]))


def server_certificate(m: Machine, hosts: Sequence[str] = ()) -> Done:
    """server.pem/server-key.pem for the host name, every address and the --host names, and ca.pem beside them.

    A certificate that already names them all is kept; one missing names is reissued with
    the old names and the new; one near its end is renewed with the same names.
    """
    cert, key, ca_copy = m.etc / "server.pem", m.etc / "server-key.pem", m.etc / CA_CERT
    want = wanted_names(m, list(hosts))
    if _foreign_certs(m):
        have = san_names(load_cert(cert))
        missing = [n for n in hosts if n not in have]
        if missing:
            raise InitError(
                f"{cert} does not name {', '.join(missing)}, and its authority is not on this machine, so it cannot "
                "be reissued here (a second authority would be one no node trusts). Issue it where the authority is: "
                f"`llmgw ctl cert issue-server {' '.join([*have, *missing])}`, and copy it to {cert}"
            )
        return Done("server certificate", "kept", f"kept {cert} (issued by an authority kept elsewhere)")
    old: list[str] = []
    reason = "made"
    if cert.exists():
        try:
            verify_issued_by(m.pki / CA_CERT, cert)
        except PKIError:
            raise InitError(
                f"{cert} was not issued by the authority in {m.pki}; nodes would not trust it. "
                "Move it (and server-key.pem) away and run init again to issue one"
            ) from None
        try:
            load_pair(cert, key)
            c = load_cert(cert)
            old = san_names(c)
            ending = near_end(c)
        except PKIError:
            old, ending = [], True  # a pair cut short by an interrupted run: issue it again
            reason = "reissued (its key was missing or did not match)"
        missing = [n for n in want if n not in old]
        if not missing and not ending:
            return Done("server certificate", "kept", f"kept {cert}: it names {', '.join(old)}")
        if missing and old:
            reason = f"added names {', '.join(missing)}"
        elif ending and old:
            reason = "renewed (near its end)"
    names = list(dict.fromkeys([*old, *want]))
    issue_server(m.pki, m.etc, names)
    m.give(key)  # the server, running as llmgw, reads its key
    _copy_ca(m, ca_copy)
    status = "made" if reason == "made" else "changed"
    lead = f"issued {cert}" if reason == "made" else f"{reason}: reissued {cert}"
    return Done("server certificate", status, f"{lead} for {', '.join(names)}")


def _copy_ca(m: Machine, ca_copy: Path) -> None:
    src = m.pki / CA_CERT
    if not ca_copy.exists() or ca_copy.read_bytes() != src.read_bytes():
        shutil.copyfile(src, ca_copy)
        ca_copy.chmod(0o644)


def ca_beside(m: Machine) -> None:
    """ca.pem beside server.pem (a run stopped between the certificate and the copy is finished here)."""
    if (m.pki / CA_CERT).exists():
        _copy_ca(m, m.etc / CA_CERT)


# ------------------------------------------------------------------ 4. server.yaml


def config_data(m: Machine, mirror: MirrorPlan | None = None, store: str | None = None) -> dict[str, Any]:
    """What server.yaml holds on a new control plane."""
    mirror = mirror or MirrorPlan(False, None, None, None, None)
    return {
        "listen": ":8080",
        "admin_listen": "127.0.0.1:9090",
        "agent_listen": ":7443",
        "data_dir": str(m.var),
        "agent_tls": {
            "ca": str(m.etc / CA_CERT),
            "cert": str(m.etc / "server.pem"),
            "key": str(m.etc / "server-key.pem"),
            # A new control plane's nodes all get marked certificates (node add, its own self-node).
            "require_node_mark": True,
        },
        "control": {"enabled": True},
        "auth": {
            "enabled": True,
            "store": store or str(m.var / "llmgw.db"),
            "default_rpm": 60,
            "default_tpm": 100000,
            "default_price": {"prompt_per_1k": 0.0005, "completion_per_1k": 0.0015},
        },
        # Nodes install llama.cpp from the mirror, so they need nothing from the internet.
        "engines": {"release_url": mirror.release_url} if mirror.release_url else None,
        "mirror": {"api": mirror.api, "token_file": mirror.token_file} if mirror.api else None,
        "models": [],
    }


_HEADER = """\
# Written by `llmgw server init`, which never overwrites it: edit it by hand.
# Mutual TLS for agents, API keys required, default limits and a price, and a
# control plane with an empty catalog (add models with `llmgw ctl model add`).
# Every key: docs/configuration.md.
"""


def server_config(m: Machine, mirror: MirrorPlan | None = None, store: str | None = None) -> tuple[Done, ServerConfig]:
    """server.yaml, written when missing; an existing one is kept and what this run would change is named."""
    want = {k: v for k, v in config_data(m, mirror, store).items() if v is not None}
    if m.config.exists():
        try:
            cfg = load_server_config(m.config)
        except ConfigError as exc:
            raise InitError(f"{m.config} is kept as it is, and it does not load: {exc}") from None
        try:
            have = yaml.safe_load(m.config.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            have = {}
        differs = [k for k in ("mirror", "engines") if have.get(k) != want.get(k)]
        if not cfg.control.enabled:
            differs.append("control.enabled")
        note = (
            f"; it differs from what this run would write in {', '.join(differs)}: edit it by hand" if differs else ""
        )
        return Done("server.yaml", "kept", f"kept {m.config} (never overwritten){note}"), cfg
    text = _HEADER + yaml.safe_dump(want, sort_keys=False)
    write_atomic(m.config, text.encode("utf-8"), 0o644)
    return Done("server.yaml", "made", f"wrote {m.config}"), load_server_config(m.config)


# ------------------------------------------------------------------ 5. the store, the default project, the admin


async def _store_step(store: Store, email: str) -> tuple[list[str], str | None]:
    made: list[str] = []
    tree = await store.tree(people=True)
    org = next((o for o in tree.orgs.values() if o.name == DEFAULT), None)
    if org is None:
        org = await store.add("org", DEFAULT)
        made.append(f"the organization {DEFAULT}")
    team = next((t for t in tree.teams.values() if t.name == DEFAULT and t.org_id == org.id), None)
    if team is None:
        team = await store.add("team", DEFAULT, org.id)
        made.append(f"the team {org.name}/{DEFAULT}")
    project = next((p for p in tree.projects.values() if p.name == DEFAULT and p.team_id == team.id), None)
    if project is None:
        project = await store.add("project", DEFAULT, team.id)
        made.append(f"the project {project.path}")
    email = email.strip().lower()
    user = next((u for u in tree.users.values() if u.email == email), None)
    password = None
    if user is None:
        password = secrets.token_urlsafe(15)
        user = await store.create_user(email, password, admin=True)
        made.append(f"the administrator {email}")
    else:
        if user.state == "pending":  # signed up on the pages before init ran: approved, or they could not sign in
            user = await store.approve(user.id)
            made.append(f"{email} approved")
        if not user.admin:
            user = await store.promote(user.id)
            made.append(f"{email} promoted to administrator (password kept)")
    tree = await store.tree(people=True)
    if not tree.reaches(user.id, project):
        await store.join(user.id, "project", project.id)
        made.append(f"{email} a member of {project.path}")
    return made, password


def store_and_admin(m: Machine, cfg: ServerConfig, email: str) -> tuple[Done, str | None]:
    """The store named by server.yaml, the default project, and the administrator, approved and promoted.

    Returns the generated password only when the account was made now; an existing
    account's password is never touched.
    """

    async def go() -> tuple[list[str], str | None]:
        store = await Store.open(cfg.auth.store)
        try:
            return await _store_step(store, email)
        finally:
            await store.close()

    try:
        made, password = asyncio.run(go())
    except StoreError as exc:
        raise InitError(f"the store {cfg.auth.store}: {exc}") from None
    db = Path(cfg.auth.store)
    for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        if p.exists():
            m.give(p)
    if made:
        return Done("store and administrator", "made", "made " + ", ".join(made)), password
    return Done(
        "store and administrator", "kept", f"kept the store {cfg.auth.store} and the administrator {email}"
    ), None


# ------------------------------------------------------------------ 6. the admin credential


def admin_credential(m: Machine, cfg: ServerConfig) -> Done:
    """data_dir/admin-token, mode 0600: the token `llmgw ctl` reads on this machine. Kept when there."""
    path = Path(cfg.data_path) / ADMIN_TOKEN_FILE

    async def go() -> bool:
        store = await Store.open(cfg.auth.store)
        try:
            return await ensure_token_file(store, path, f"server init ({path})")
        finally:
            await store.close()

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    try:
        made = asyncio.run(go())
    except (StoreError, OSError) as exc:
        raise InitError(f"the admin token {path}: {exc}") from None
    m.give(path)
    if made:
        return Done("admin credential", "made", f"made the admin token {path} (mode 0600) for `llmgw ctl`")
    return Done("admin credential", "kept", f"kept the admin token {path}")


# ------------------------------------------------------------------ 7. the unit


def server_unit(m: Machine, cfg: ServerConfig, *, restart: bool = False) -> Done:
    """llmgw-server.service written when its text differs; started and /health awaited only where systemd runs."""
    path = m.units / SERVER_UNIT
    text = server_unit_text(binary=m.binary, config=str(m.config), data_dir=cfg.data_path)
    wrote = write_unit(path, text)
    did = f"{wrote} {path}" if wrote else f"kept {path}"
    if not m.systemd:
        return Done(
            "server unit",
            "made" if wrote else "kept",
            f"{did}; not started: systemd is not running here (no /run/systemd/system). Start it with "
            f"`systemctl daemon-reload && systemctl enable --now {SERVER_UNIT}` where systemd runs, or run "
            f"`{m.binary} server --config {m.config}` in the foreground",
        )
    steps: list[str] = [did]
    if wrote:
        _must(m, ["systemctl", "daemon-reload"], "reloading systemd")
    enabled = m.run(["systemctl", "is-enabled", "--quiet", SERVER_UNIT])[0] == 0
    active = m.run(["systemctl", "is-active", "--quiet", SERVER_UNIT])[0] == 0
    if not enabled or not active:
        _must(m, ["systemctl", "enable", "--now", SERVER_UNIT], f"starting {SERVER_UNIT}")
        steps.append("enabled and started it")
    elif wrote == "updated" or restart:
        _must(m, ["systemctl", "restart", SERVER_UNIT], f"restarting {SERVER_UNIT}")
        steps.append("restarted it" + (" with the new certificate" if restart else ""))
    else:
        steps.append("it is enabled and running")
    url = f"http://{_host(cfg.admin_listen.connect_host)}:{cfg.admin_listen.port}/health"
    await_health(m, url)
    steps.append(f"{url} answers")
    changed = wrote is not None or any("started" in s for s in steps)
    return Done("server unit", "changed" if changed else "kept", "; ".join(steps))


def await_health(m: Machine, url: str, unit: str = SERVER_UNIT) -> None:
    """Until ``url`` answers, or m.health_timeout passes (then the unit's journal is the place to look)."""
    deadline = time.monotonic() + m.health_timeout
    while not m.health(url):
        if time.monotonic() > deadline:
            raise InitError(
                f"{unit} started but {url} did not answer within {m.health_timeout:g} s; "
                f"see `journalctl -u {unit}`, fix what it says and run init again"
            )
        time.sleep(0.5)


def _host(h: str) -> str:
    return f"[{h}]" if ":" in h else h


def _must(m: Machine, argv: list[str], doing: str) -> str:
    rc, out = m.run(argv)
    if rc != 0:
        raise InitError(f"{doing} failed ({' '.join(argv)}): {out or f'exit status {rc}'}")
    return out
