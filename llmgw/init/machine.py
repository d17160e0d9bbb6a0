"""What `server init` acts on: a root prefix for every path, a runner for commands, the machine's names.

In production the root is ``/``; tests give a temporary directory and a fake
runner, so the real steps run without root or systemd.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.admin_api import AdminAPI
from llmgw.units import UNITS_DIR

USER = "llmgw"
DEFAULT_BINARY = "/usr/local/bin/llmgw"
COMMAND_TIMEOUT = 120.0
# A package manager installing PostgreSQL from a slow mirror: long, not forever.
LONG_COMMAND_TIMEOUT = 1800.0

Runner = Callable[[list[str]], tuple[int, str]]


def run_command(argv: list[str], timeout: float = COMMAND_TIMEOUT) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    except FileNotFoundError:
        return 127, f"{argv[0]} is not installed"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(argv)} did not finish in {timeout:g} s"
    return p.returncode, (p.stdout + p.stderr).strip()


def parse_ip_addr(text: str) -> list[str]:
    """The addresses in `ip -j addr`'s output, link-local ones left out (they need a zone to be dialled)."""
    found: list[str] = []
    for iface in json.loads(text or "[]"):
        for info in iface.get("addr_info", []):
            local = info.get("local")
            if not local or info.get("scope") == "link":
                continue
            try:
                addr = ipaddress.ip_address(local)
            except ValueError:
                continue
            if addr.is_link_local:
                continue
            if str(addr) not in found:
                found.append(str(addr))
    return found


def machine_addresses(run: Runner = run_command) -> list[str]:
    """Every address this machine has: `ip -j addr`, else what its host name resolves to, and loopback."""
    rc, out = run(["ip", "-j", "addr"])
    found: list[str] = []
    if rc == 0:
        try:
            found = parse_ip_addr(out)
        except (ValueError, AttributeError):
            found = []
    if not found:
        try:
            infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
            found = sorted({str(i[4][0]) for i in infos if not ipaddress.ip_address(i[4][0]).is_link_local})
        except OSError:
            found = []
    if "127.0.0.1" not in found:
        found.append("127.0.0.1")
    return found


def machine_names() -> list[str]:
    """The host name, its fully qualified form when it has one, and localhost."""
    names = [socket.gethostname()]
    fqdn = socket.getfqdn()
    if "." in fqdn and fqdn not in names and not fqdn.startswith("localhost"):
        names.append(fqdn)
    names.append("localhost")
    return [n for n in dict.fromkeys(names) if n]


def own_binary() -> str:
    """The executable the units run: this frozen binary, or the installed `llmgw`."""
    if getattr(sys, "frozen", False):
        return os.path.realpath(sys.executable)
    return shutil.which("llmgw") or DEFAULT_BINARY


def health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


@dataclass
class Machine:
    """Where `server init` writes and how it acts. ``root`` prefixes every path it touches."""

    root: Path = Path("/")
    run: Runner = run_command
    names: list[str] = field(default_factory=machine_names)
    addresses: list[str] = field(default_factory=list)
    binary: str = DEFAULT_BINARY
    # Files handed to the llmgw user (chown) only when init runs as root on the real machine.
    give_files: bool = False
    health: Callable[[str], bool] = health_ok
    health_timeout: float = 60.0
    # The control plane's admin API at a URL with a token (tests give a fake).
    admin: Callable[[str, str | None], AdminAPI] = AdminAPI
    node_timeout: float = 600.0  # a node registering and installing llama.cpp from the mirror
    model_timeout: float = 1800.0  # the starter model fetched by the node and started
    # The role and the database `--postgres` makes (tests give a throwaway name on a shared server).
    pg_name: str = "llmgw"

    def run_long(self, argv: list[str]) -> tuple[int, str]:
        """A command that may take many minutes (a package manager): the real runner with a longer limit,
        or the runner given (a fake)."""
        if self.run is run_command:
            return run_command(argv, timeout=LONG_COMMAND_TIMEOUT)
        return self.run(argv)

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    @property
    def etc(self) -> Path:
        return self.path("/etc/llmgw")

    @property
    def pki(self) -> Path:
        return self.etc / "pki"

    @property
    def var(self) -> Path:
        return self.path("/var/lib/llmgw")

    @property
    def config(self) -> Path:
        return self.etc / "server.yaml"

    @property
    def units(self) -> Path:
        return self.path(UNITS_DIR)

    @property
    def systemd(self) -> bool:
        """systemd is PID 1 here (its runtime directory exists), so units can be started."""
        return self.path("/run/systemd/system").is_dir()

    def give(self, path: Path) -> None:
        """Hand a file or directory to the llmgw user, when running as root for real; no-op otherwise."""
        if not self.give_files:
            return
        pw = pwd.getpwnam(USER)
        st = path.stat()
        if (st.st_uid, st.st_gid) != (pw.pw_uid, pw.pw_gid):
            os.chown(path, pw.pw_uid, pw.pw_gid)
