"""Real machines for the onboarding tests: systemd as PID 1 and sshd, booted with systemd-nspawn.

Every machine boots from the one Debian root ``scripts/build-test-machine-root`` caches, read-only
with ``--volatile=overlay`` (its writes go to memory and go away with it), on a bridge made for the
``Machines`` that booted it, with a static address from a ``systemd-networkd`` file. Root logs in with
the test key the build made; the machines share one set of host keys, so host-key checks are skipped
for them (``change_host_key`` gives one machine its own, for the refusal test). See docs/testing.md,
"Machines for onboarding tests".

What it needs: root, ``systemd-nspawn`` (Debian's systemd-container) and the cgroup v1 hybrid layout
(``/sys/fs/cgroup/systemd`` beside ``/sys/fs/cgroup/unified``): without a systemd on the host, each
nspawn is moved into its own cgroup directory there by hand, or the machines would share one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncssh
from harness import REPO, Proc

from llmgw.testing.waiting import until

BUILD_ROOT = REPO / "scripts" / "build-test-machine-root"
CGROUP_HIERARCHIES = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"))
# The host's end of bridge N is 10.213.N.1; its machines are .10, .11, ...
SUBNETS = "10.213.{}.0/24"
FIRST_HOST = 10
# Seconds: a boot on two loaded cores takes a few; these are backstops, not paces.
BOOT_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0
SSH_ERRORS = (OSError, asyncssh.Error, asyncio.TimeoutError)

T = TypeVar("T")


def unavailable() -> str | None:
    """Why machines cannot be booted here, or None when they can."""
    if os.geteuid() != 0:
        return "booting machines with systemd-nspawn needs root"
    for tool, package in (("systemd-nspawn", "systemd-container"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            return f"no {tool} here (apt-get install {package})"
    missing = [str(p) for p in CGROUP_HIERARCHIES if not p.is_dir()]
    if missing:
        # A pure cgroup v2 host (or one run by systemd) needs a different placement of each nspawn.
        return f"this harness needs the cgroup v1 hybrid layout; missing {', '.join(missing)}"
    return None


def build_root() -> Path:
    """The cached machine root, built first when it is not there (about 3 minutes, once)."""
    out = subprocess.run([str(BUILD_ROOT)], check=True, capture_output=True, text=True)
    root = Path(out.stdout.strip().splitlines()[-1])
    if not (root / "usr" / "lib" / "systemd" / "systemd").exists():
        raise RuntimeError(f"{BUILD_ROOT} printed {root}, which holds no systemd")
    return root


@dataclass
class Result:
    exit_status: int
    stdout: str
    stderr: str


@dataclass
class Machine:
    name: str
    address: str
    proc: Proc
    cgroups: list[Path] = field(default_factory=list)

    def alive(self) -> bool:
        return self.proc.alive()


def _cgroup_pids(top: Path) -> list[int]:
    pids: list[int] = []
    for d, _, _ in os.walk(top):
        try:
            pids += [int(p) for p in (Path(d) / "cgroup.procs").read_text().split()]
        except OSError:
            pass
    return pids


def _remove_cgroup(top: Path) -> bool:
    """Remove a cgroup directory and those the machine's systemd made under it; True when gone."""
    for d, _, _ in os.walk(top, topdown=False):
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return not top.exists()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class Machines:
    """Boots machines on a bridge of their own; ``with Machines(root, workdir) as m: m.boot("a", "b")``.

    Leaving the block powers off every machine still running, removes their cgroup directories and the
    bridge, also when the test failed. The SSH helpers are synchronous (asyncssh in a worker thread), so
    they work from plain and from asyncio tests alike.
    """

    def __init__(self, root: Path, workdir: Path) -> None:
        self.root = root
        self.key = root.parent / "id_ed25519"
        self.workdir = workdir
        self.machines: dict[str, Machine] = {}
        self.bridge = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="machines-ssh")

    # -- the bridge --------------------------------------------------------------------------------

    def __enter__(self) -> Machines:
        self.workdir.mkdir(parents=True, exist_ok=True)
        used = _ip("-o", "-4", "addr", "show").stdout
        for n in range(256):
            subnet = ipaddress.IPv4Network(SUBNETS.format(n))
            if f" {subnet.network_address + 1}/" in used:
                continue
            # Fails when the name is taken (a stale bridge, or another session's): try the next.
            if _ip("link", "add", f"llmgwbr{n}", "type", "bridge", check=False).returncode == 0:
                self.bridge, self.subnet = f"llmgwbr{n}", subnet
                break
        else:
            raise RuntimeError("no free llmgwbrN bridge name and 10.213.N.0/24 subnet")
        try:
            _ip("addr", "add", f"{self.subnet.network_address + 1}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            _ip("link", "del", self.bridge, check=False)
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        problems: list[str] = []
        try:
            problems = self._stop_all()
        finally:
            if self.bridge:
                gone = _ip("link", "del", self.bridge, check=False)
                if gone.returncode != 0:
                    problems.append(f"bridge {self.bridge} not removed: {gone.stderr.strip()}")
            self._pool.shutdown(wait=False, cancel_futures=True)
        if problems and exc_type is None:
            raise AssertionError("machines left behind: " + "; ".join(problems))

    @property
    def host_address(self) -> str:
        """The host's own address on the bridge, as the machines reach it."""
        assert self.subnet is not None, "use Machines as a context manager"
        return str(self.subnet.network_address + 1)

    # -- booting -----------------------------------------------------------------------------------

    def boot(self, *names: str, timeout: float = BOOT_TIMEOUT) -> list[Machine]:
        """Boot machines with these names (their hostnames), all at once; return when each accepts SSH."""
        assert self.subnet is not None, "use Machines as a context manager"
        started = [self._start(name) for name in names]
        for m in started:
            until(
                lambda m=m: self._run(self._ssh(m.address, "true"), 15.0).exit_status == 0,
                timeout,
                f"machine {m.name} ({m.address}) to accept SSH",
                alive=[m.proc],
                ignore=SSH_ERRORS,
                interval=0.2,
            )
        return started

    def _start(self, name: str) -> Machine:
        if name in self.machines:
            raise ValueError(f"a machine named {name} was already booted here")
        assert self.subnet is not None
        address = str(self.subnet.network_address + FIRST_HOST + len(self.machines))
        network = self.workdir / f"{name}.network"
        # Replaces the image's own 80-container-host0.network (DHCP, which nothing here answers).
        network.write_text(
            "[Match]\nName=host0\n\n[Network]\n"
            f"Address={address}/{self.subnet.prefixlen}\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n"
        )
        cgroups = [h / f"llmgw-{self.bridge}-{name}" for h in CGROUP_HIERARCHIES]
        for c in cgroups:
            c.mkdir(exist_ok=True)
        cmd = [
            "systemd-nspawn",
            "--boot",
            "--register=no",  # the host has no systemd (no machined, no bus) ...
            "--keep-unit",  # ... so nspawn stays in the cgroup it was started in, its own (below)
            "--volatile=overlay",  # the shared root read-only, this machine's writes in memory
            f"--directory={self.root}",
            f"--machine={name}",
            f"--network-bridge={self.bridge}",
            f"--bind-ro={network}:/etc/systemd/network/80-container-host0.network",
            "--console=passive",
        ]

        def own_cgroup() -> None:  # in the child, before exec: nspawn and its machine get their own cgroups
            for c in cgroups:
                (c / "cgroup.procs").write_text(str(os.getpid()))

        log = self.workdir / f"{name}.log"
        proc = _Nspawn(cmd, log, own_cgroup)
        m = Machine(name, address, proc, cgroups)
        self.machines[name] = m
        return m

    def address(self, name: str) -> str:
        return self.machines[name].address

    # -- SSH ---------------------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return self._pool.submit(asyncio.run, asyncio.wait_for(coro, timeout)).result()

    def _connect(self, address: str) -> Any:
        # The machines share host keys (and change_host_key changes one), so they are not checked here.
        return asyncssh.connect(
            address,
            username="root",
            client_keys=[str(self.key)],
            known_hosts=None,
            agent_path=None,
            config=(),
            connect_timeout=10,
        )

    async def _ssh(self, address: str, cmd: str) -> Result:
        async with self._connect(address) as conn:
            r = await conn.run(cmd, check=False)
        out, err = r.stdout, r.stderr
        return Result(
            r.exit_status if r.exit_status is not None else -1,
            out if isinstance(out, str) else "",
            err if isinstance(err, str) else "",
        )

    def ssh(self, name: str, cmd: str, check: bool = True, timeout: float = 120.0) -> Result:
        """Run a shell command on a machine as root; with ``check`` a non-zero exit fails with its output."""
        r = self._run(self._ssh(self.address(name), cmd), timeout)
        if check and r.exit_status != 0:
            raise AssertionError(f"{cmd!r} on {name} exited {r.exit_status}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        return r

    def copy_in(self, name: str, local: Path | str, remote: str, timeout: float = 300.0) -> None:
        """Copy a local file (or directory, recursively) to a path on a machine over SFTP."""

        async def put() -> None:
            async with self._connect(self.address(name)) as conn, conn.start_sftp_client() as sftp:
                await sftp.put(str(local), remote, recurse=True, preserve=True)

        self._run(put(), timeout)

    def host_key(self, name: str) -> str:
        """The machine's SSH host key as sshd now offers it, in OpenSSH's public-key form."""

        async def get() -> str:
            key = await asyncssh.get_server_host_key(self.address(name), 22)
            assert key is not None
            return key.export_public_key().decode().strip()

        return self._run(get(), 30.0)

    def change_host_key(self, name: str, timeout: float = 60.0) -> str:
        """Give one machine host keys of its own (in its overlay), restart sshd, return the new key."""
        old = self.host_key(name)
        self.ssh(name, "rm -f /etc/ssh/ssh_host_* && ssh-keygen -q -A && systemctl restart ssh.service")
        m = self.machines[name]
        return str(
            until(
                lambda: (k := self.host_key(name)) != old and self._run(self._ssh(m.address, "true"), 15.0) and k,
                timeout,
                f"{name}'s sshd to offer its new host key",
                alive=[m.proc],
                ignore=SSH_ERRORS,
                interval=0.2,
            )
        )

    # -- powering off ------------------------------------------------------------------------------

    def poweroff(self, name: str, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM to nspawn (a clean shutdown of the machine); wait for it to exit; return its status."""
        m = self.machines[name]
        if m.alive():
            m.proc.proc.send_signal(signal.SIGTERM)
        until(lambda: not m.alive(), timeout, f"machine {name} to power off", procs=[m.proc], interval=0.1)
        self._forget(m)
        rc = m.proc.proc.returncode
        assert rc is not None
        return rc

    def _forget(self, m: Machine) -> list[str]:
        """After nspawn exited: kill what is left in the machine's cgroups (after a SIGKILL), remove them."""
        problems = []
        for c in m.cgroups:
            try:
                until(lambda c=c: _remove_cgroup(c), 10.0, f"cgroup {c} to empty", interval=0.1)
            except AssertionError:
                for pid in _cgroup_pids(c):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    until(lambda c=c: _remove_cgroup(c), 10.0, f"cgroup {c} to empty after SIGKILL", interval=0.1)
                except AssertionError as exc:
                    problems.append(str(exc).splitlines()[0])
        return problems

    def _stop_all(self) -> list[str]:
        problems: list[str] = []
        running = [m for m in self.machines.values() if m.alive()]
        for m in running:
            m.proc.proc.send_signal(signal.SIGTERM)
        for m in running:
            try:
                until(lambda m=m: not m.alive(), STOP_TIMEOUT, f"machine {m.name} to power off", interval=0.1)
            except AssertionError:
                problems.append(f"{m.name} did not power off within {STOP_TIMEOUT}s of SIGTERM; killed")
                m.proc.kill()
        for m in self.machines.values():
            if any(c.exists() for c in m.cgroups):
                problems += self._forget(m)
        return problems


class _Nspawn(Proc):
    """A harness Proc (log, alive, text) started with a hook that runs in the child before exec."""

    def __init__(self, cmd: list[str], log: Path, before_exec: Callable[[], None]) -> None:
        self.cmd, self.log = cmd, log
        with open(log, "ab") as logf:
            self.proc = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=before_exec
            )
