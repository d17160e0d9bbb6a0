"""``llmgw mirror init``: the mirror's own user, its directory and a hardened systemd unit.

Every command goes through a runner (``list[str] -> (returncode, output)``)
so the whole sequence can be tested without root or systemd, and each step
first looks at what is there: running it again changes only what differs
and says so.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llmgw import units
from llmgw.files import write_atomic
from llmgw.mirror.api import default_token_file, ensure_token
from llmgw.mirror.layout import MirrorError

UNIT_NAME = "llmgw-mirror.service"
DEFAULT_UNIT_PATH = "/etc/systemd/system/" + UNIT_NAME
DEFAULT_BINARY = "/usr/local/bin/llmgw"

Runner = Callable[[list[str]], tuple[int, str]]
Resolver = Callable[[str], list[str]]


def run_command(argv: list[str]) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]} is not installed"
    return p.returncode, (p.stdout + p.stderr).strip()


def resolve_host(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(i[4][0]) for i in infos})


def control_plane_allow(address: str, resolve: Resolver = resolve_host) -> list[str]:
    """The --api-allow values for a control plane given as an address, a network,
    a host name, any of them with a :port or as a URL."""
    text = address.strip()
    if "://" in text:
        text = text.split("://", 1)[1].split("/", 1)[0]
    if text.startswith("["):  # [v6]:port
        text = text[1:].split("]", 1)[0]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    if not text:
        raise MirrorError(f'--control-plane "{address}" names no host; give its address, e.g. 10.0.0.5')
    try:
        return [str(ipaddress.ip_network(text, strict=False)) if "/" in text else str(ipaddress.ip_address(text))]
    except ValueError:
        pass
    try:
        found = resolve(text)
    except OSError as exc:
        raise MirrorError(
            f"cannot resolve {text} ({exc.strerror or exc}); pass the control plane's IP address"
        ) from None
    if not found:
        raise MirrorError(f"{text} resolves to no address; pass the control plane's IP address")
    return found


def unit_text(
    *,
    dir: str,
    user: str,
    base: str,
    allow: list[str],
    token_file: str,
    binary: str = DEFAULT_BINARY,
    listen: str = ":8081",
    api_listen: str = ":8082",
) -> str:
    args = [
        binary,
        "mirror",
        "serve",
        "--dir",
        dir,
        "--listen",
        listen,
        "--api-listen",
        api_listen,
        "--base",
        base,
        "--api-token-file",
        token_file,
    ]
    for a in allow:
        args += ["--api-allow", a]
    pairs = [args[:3]] + [args[i : i + 2] for i in range(3, len(args), 2)]
    return units.unit_text(
        description="llmgw model mirror",
        exec_start=pairs,
        service=[
            f"User={user}",
            f"Group={user}",
            "Restart=on-failure",
            "RestartSec=2s",
            "NoNewPrivileges=true",
            "ProtectSystem=strict",
            "ProtectHome=true",
            "PrivateTmp=true",
            f"ReadWritePaths={units.quote(dir)}",
        ],
    )


@dataclass
class InitResult:
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    token_file: str = ""


def _must(run: Runner, argv: list[str], doing: str) -> str:
    rc, out = run(argv)
    if rc != 0:
        raise MirrorError(f"{doing} failed ({' '.join(argv)}): {out or f'exit status {rc}'}")
    return out


def init_mirror(
    *,
    control_plane: str,
    dir: str,
    unit_path: str = DEFAULT_UNIT_PATH,
    user: str = "llmgw",
    base: str,
    binary: str = DEFAULT_BINARY,
    run: Runner = run_command,
    resolve: Resolver = resolve_host,
    api_listen: str = ":8082",
    start: bool = True,
) -> InitResult:
    """Bring the machine to: user exists, dir exists (owned by it when created), the API
    token beside it (owned by it when made), the unit holds exactly this text, systemd
    knows it, it is enabled and running."""
    res = InitResult()
    allow = control_plane_allow(control_plane, resolve)
    d = Path(dir)
    if not d.is_absolute():
        raise MirrorError(f"--dir {dir} must be an absolute path; the unit runs from /")

    if run(["id", "-u", user])[0] == 0:
        res.unchanged.append(f"the user {user} exists")
    else:
        _must(
            run,
            [
                "useradd",
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                dir,
                "--shell",
                "/usr/sbin/nologin",
                user,
            ],
            f"creating the user {user}",
        )
        res.changed.append(f"created the system user {user}")

    if d.is_dir():
        res.unchanged.append(f"{dir} exists")
    elif d.exists():
        raise MirrorError(f"{dir} exists and is not a directory; move it away or choose another --dir")
    else:
        try:
            d.mkdir(parents=True, mode=0o755)
        except OSError as exc:
            raise MirrorError(f"cannot create {dir}: {exc.strerror or exc} (run it with sudo)") from None
        _must(run, ["chown", f"{user}:{user}", dir], f"giving {dir} to {user}")
        res.changed.append(f"created {dir}, owned by {user}")

    # Made here, as root: the unit may write only inside the directory, and the token lives beside it.
    token_file = default_token_file(dir)
    res.token_file = str(token_file)
    _, made = ensure_token(token_file)
    if made:
        _must(run, ["chown", f"{user}:{user}", str(token_file)], f"giving {token_file} to {user}")
        res.changed.append(f"made the management API token {token_file} (mode 0600, owned by {user})")
    else:
        res.unchanged.append(f"the API token {token_file} exists")

    text = unit_text(
        dir=dir, user=user, base=base, allow=allow, token_file=str(token_file), binary=binary, api_listen=api_listen
    )
    unit = Path(unit_path)
    try:
        old = unit.read_text() if unit.exists() else None
    except OSError as exc:
        raise MirrorError(f"cannot read {unit}: {exc.strerror or exc}") from None
    unit_changed = old != text
    if unit_changed:
        try:
            write_atomic(unit, text.encode("utf-8"), 0o644)
        except OSError as exc:
            raise MirrorError(f"cannot write {unit}: {exc.strerror or exc} (run it with sudo)") from None
        res.changed.append(f"{'wrote' if old is None else 'updated'} {unit} (--api-allow {', '.join(allow)})")
        if start:
            _must(run, ["systemctl", "daemon-reload"], "reloading systemd")
    else:
        res.unchanged.append(f"{unit} is as it should be")
    if not start:  # systemd is not running here (a trial under a root directory): the unit is written only
        return res

    name = unit.name
    enabled = run(["systemctl", "is-enabled", "--quiet", name])[0] == 0
    active = run(["systemctl", "is-active", "--quiet", name])[0] == 0
    if not enabled or not active:
        _must(run, ["systemctl", "enable", "--now", name], f"starting {name}")
        res.changed.append(f"enabled and started {name}")
    elif unit_changed and old is not None:
        _must(run, ["systemctl", "restart", name], f"restarting {name}")
        res.changed.append(f"restarted {name} with the new unit")
    else:
        res.unchanged.append(f"{name} is enabled and running")
    return res
