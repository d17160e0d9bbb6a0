"""One SSH connection to a machine being made a node, over asyncssh, as `node add` needs it.

* It waits for SSH to answer rather than failing (a machine still booting).
* Host keys as OpenSSH's ``accept-new``: a host never seen is learned into the
  known-hosts file, one seen before must present the same key, and a changed
  key is refused before anything is sent.
* Commands run as root: directly when the login user is root, else under
  ``sudo -n`` (passwordless sudo is checked once, with the fix when missing).
* stdout and stderr are kept apart, so a warning on stderr is never taken for
  the answer (the host name, a checksum, doctor's JSON).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from llmgw.files import sha256_file
from llmgw.onboard import OnboardError

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


@dataclass(frozen=True)
class Target:
    """``[user@]host`` and the port, as the operator named the machine."""

    host: str
    user: str = "root"
    port: int = 22

    @classmethod
    def parse(cls, text: str, port: int = 22) -> Target:
        user, sep, host = text.rpartition("@")
        host = host.strip()
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not host or (sep and not user):
            raise OnboardError(f"{text!r} is not [user@]host; give e.g. root@10.0.0.21 or ubuntu@node-b")
        return cls(host=host, user=user or "root", port=port)

    def __str__(self) -> str:
        return f"{self.user}@{self.host}" + (f":{self.port}" if self.port != 22 else "")

    @property
    def known_hosts_name(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


@dataclass
class Result:
    status: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.status == 0

    def words(self) -> str:
        return (self.stderr.strip() or self.stdout.strip() or f"exit status {self.status}")[-2000:]


def known_keys(path: Path, name: str) -> list[str]:
    """The keys (``type base64``) the known-hosts file holds for ``name`` (plain entries; hashed ones are
    read by asyncssh itself when it verifies)."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split()
        if len(parts) >= 3 and not line.startswith("#") and name in parts[0].split(","):
            found.append(f"{parts[1]} {parts[2]}")
    return found


def _has_entry(path: Path, name: str) -> bool:
    if known_keys(path, name):
        return True
    if not path.exists():
        return False
    try:
        return bool(asyncssh.read_known_hosts(str(path)).match(name, "", None)[0])
    except (OSError, ValueError, asyncssh.Error):
        return False


def _append_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


class Session:
    """An open connection; :meth:`run` as root, :meth:`push` a file by SFTP."""

    def __init__(self, target: Target, conn: asyncssh.SSHClientConnection) -> None:
        self.target = target
        self.conn = conn
        self.sudo = target.user != "root"

    async def raw(self, command: str, *, input: bytes | str | None = None, timeout: float = 300.0) -> Result:
        try:
            r = await asyncio.wait_for(
                self.conn.run(
                    command, input=input, check=False, encoding=None if isinstance(input, bytes) else "utf-8"
                ),
                timeout,
            )
        except TimeoutError:
            raise OnboardError(f"{self.target.host}: `{command[:80]}` did not finish in {timeout:g} s") from None
        except (OSError, asyncssh.Error) as exc:
            raise OnboardError(f"{self.target.host}: the SSH connection broke ({exc})") from None

        def text(v: object) -> str:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v or "")

        return Result(r.exit_status if r.exit_status is not None else 255, text(r.stdout), text(r.stderr))

    async def run(self, command: str, *, input: bytes | str | None = None, timeout: float = 300.0) -> Result:
        """``command`` (a shell line) as root."""
        line = f"sudo -n -- sh -c {shlex.quote(command)}" if self.sudo else command
        return await self.raw(line, input=input, timeout=timeout)

    async def must(self, command: str, doing: str, *, input: bytes | str | None = None, timeout: float = 300.0) -> str:
        r = await self.run(command, input=input, timeout=timeout)
        if not r.ok:
            raise OnboardError(f"{self.target.host}: {doing} failed: {r.words()}")
        return r.stdout

    async def check_sudo(self) -> None:
        if not self.sudo:
            return
        r = await self.raw("sudo -n true")
        if not r.ok:
            raise OnboardError(
                f"{self.target.host}: {self.target.user} cannot use sudo without a password ({r.words()}); give it "
                f"passwordless sudo (e.g. `{self.target.user} ALL=(ALL) NOPASSWD:ALL` in /etc/sudoers.d/llmgw) "
                "or log in as root"
            )

    async def write(self, path: str, data: bytes, mode: int) -> None:
        """``path`` written as root, atomically (a temporary beside it, then renamed), with ``mode``."""
        tmp = f"{path}.llmgw-new"
        q, qt = shlex.quote(path), shlex.quote(tmp)
        await self.must(
            f"mkdir -p {shlex.quote(str(Path(path).parent))} && umask 077 && cat > {qt} && chmod {mode:o} {qt} && mv -f {qt} {q}",
            f"writing {path}",
            input=data,
        )

    async def sha256(self, path: str) -> str | None:
        r = await self.run(f"sha256sum {shlex.quote(path)} 2>/dev/null")
        return r.stdout.split()[0] if r.ok and r.stdout.strip() else None

    async def push(self, local: Path, path: str, mode: int = 0o755) -> bool:
        """``local`` to ``path`` over SFTP, checked by sha256 on the machine, then moved into place as root.
        False when the file there is already the same (nothing sent)."""
        want = sha256_file(local)
        if await self.sha256(path) == want:
            return False
        tmp = f"/tmp/.llmgw-upload-{os.getpid()}-{time.monotonic_ns()}"
        try:
            async with self.conn.start_sftp_client() as sftp:
                await sftp.put(str(local), tmp)
        except (OSError, asyncssh.Error) as exc:
            raise OnboardError(f"{self.target.host}: copying {local.name} over SFTP failed ({exc})") from None
        got = await self.sha256(tmp)
        if got != want:
            await self.run(f"rm -f {shlex.quote(tmp)}")
            raise OnboardError(
                f"{self.target.host}: the copy of {local.name} arrived with sha256 {got or 'unreadable'}, not {want}; "
                "run node add again (a full disk or a broken link)"
            )
        q, qt = shlex.quote(path), shlex.quote(tmp)
        await self.must(
            f"install -m {mode:o} -T {qt} {q}.llmgw-new && mv -f {q}.llmgw-new {q}; rc=$?; rm -f {qt}; exit $rc",
            f"installing {path}",
        )
        return True

    async def close(self) -> None:
        self.conn.close()
        try:
            await asyncio.wait_for(self.conn.wait_closed(), 5)
        except (TimeoutError, OSError, asyncssh.Error):
            pass


async def connect(
    target: Target,
    *,
    identity: str | None = None,
    known_hosts: str = DEFAULT_KNOWN_HOSTS,
    wait: float = 120.0,
) -> tuple[Session, str | None]:
    """An open session, once SSH answers (trying for ``wait`` seconds), with the host key checked; and what
    was learned (the key added to the known-hosts file) or None."""
    kh = Path(os.path.expanduser(known_hosts))
    name = target.known_hosts_name
    seen = _has_entry(kh, name)
    options: dict[str, object] = {
        "username": target.user,
        "port": target.port,
        "known_hosts": str(kh) if seen else None,
        "connect_timeout": 10,
    }
    if identity:
        options["client_keys"] = [os.path.expanduser(identity)]
    deadline = time.monotonic() + wait
    while True:
        try:
            conn = await asyncssh.connect(target.host, **options)  # type: ignore[arg-type]
            break
        except asyncssh.HostKeyNotVerifiable:
            raise OnboardError(
                f"{target.host} presented a host key other than the one in {kh}: it changed since it was first seen. "
                f"If the machine was reinstalled, remove its old key with `ssh-keygen -f {kh} -R {name}` and run "
                "node add again; otherwise someone may be in the way: do not go on"
            ) from None
        except asyncssh.PermissionDenied as exc:
            raise OnboardError(
                f"{target}: SSH refused the login ({exc.reason}); give the key with --identity FILE, or run with an "
                "agent holding it (`ssh -A` to this machine, then `sudo --preserve-env=SSH_AUTH_SOCK llmgw node add …`)"
            ) from None
        except (OSError, TimeoutError, asyncssh.Error) as exc:
            if time.monotonic() > deadline:
                raise OnboardError(
                    f"{target}: SSH did not answer within {wait:g} s ({type(exc).__name__}: {exc}); is the machine up "
                    "and is sshd running?"
                ) from None
            await asyncio.sleep(2.0)
    learned = None
    if not seen:
        key = conn.get_server_host_key()
        if key is not None:
            kind, blob = key.export_public_key("openssh").decode().split()[:2]
            line = f"{name} {kind} {blob}"
            await asyncio.to_thread(_append_line, kh, line)
            learned = f"learned {target.host}'s host key into {kh} ({key.get_algorithm()})"
    return Session(target, conn), learned
