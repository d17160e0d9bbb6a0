"""The processes `up` starts beside itself (the agent, the mirror) and the last guard for the engines."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmgw.mirror.api import default_token_file, ensure_token
from llmgw.mirror.layout import MirrorError
from llmgw.up import UpError
from llmgw.up.config import free_port

log = logging.getLogger("llmgw.up")


def llmgw_command(*args: str) -> list[str]:
    """How to run this llmgw itself: the one-file build is its own executable."""
    if getattr(sys, "frozen", False):
        return [sys.executable, *args]
    return [sys.executable, "-m", "llmgw.cli.main", *args]


def agent_command(config_path: Path) -> list[str]:
    """How to run this llmgw's own agent."""
    return llmgw_command("agent", "--config", str(config_path))


def mirror_command(root: Path, listen: str, api_listen: str, base: str, token_file: Path) -> list[str]:
    """How to run this llmgw's own mirror over ``root``; its API is left on loopback (allowed: this machine)
    and needs the token in ``token_file`` like any mirror's."""
    return llmgw_command(
        "mirror",
        "--dir",
        str(root),
        "serve",
        "--listen",
        listen,
        "--api-listen",
        api_listen,
        "--base",
        base,
        "--api-allow",
        "127.0.0.1",
        "--api-token-file",
        str(token_file),
    )


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Child:
    """A process `up` starts beside itself, logging to a file, in a session of its own."""

    what = "a process"

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log_file:
            # Its own session: a Ctrl-C reaches `up` alone, which stops the others in order.
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 20) -> str:
        return tail(self.log_path, lines)

    def stop(self, timeout: float = 40.0) -> None:
        """SIGTERM, then SIGKILL to its group when it does not end in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs; killing it", self.what, timeout)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


class AgentProcess(Child):
    """The local agent, a process of its own; it stops the engines it started when it stops (SIGTERM)."""

    what = "the agent"

    def __init__(self, config_path: Path, log_path: Path) -> None:
        super().__init__(agent_command(config_path), log_path)


class MirrorProcess(Child):
    """`llmgw mirror serve` over ``root``: bytes on one loopback port, the management API on another.

    It inherits up's environment, so HF_ENDPOINT and HF_TOKEN reach its fetcher (an HF_ENDPOINT on
    loopback included: the endpoint the operator set is the one local source a mirror fetches from
    without --allow-local-sources). Its API token is ``<root>.api-token``, made by `up` before the
    mirror starts, so server.yaml and up's own calls never wait on the mirror's first start.
    """

    what = "the mirror"

    def __init__(
        self, root: Path, log_path: Path, weights_port: int | None = None, api_port: int | None = None
    ) -> None:
        self.root = root
        self.weights_port = weights_port or free_port()
        self.api_port = api_port or free_port()
        self.base = f"http://127.0.0.1:{self.weights_port}"
        self.api = f"http://127.0.0.1:{self.api_port}"
        self.token_file = default_token_file(root)
        self.token: str | None = None
        super().__init__(
            mirror_command(
                root, f"127.0.0.1:{self.weights_port}", f"127.0.0.1:{self.api_port}", self.base, self.token_file
            ),
            log_path,
        )

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.token, _ = ensure_token(self.token_file)
        except MirrorError as exc:
            raise UpError(str(exc)) from None
        super().start()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until its management API answers; UpError with its last log lines when it does not."""
        deadline = time.monotonic() + timeout
        while True:
            rc = self.exited()
            if rc is not None:
                raise UpError(f"the mirror exited with status {rc}; its last lines ({self.log_path}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.api}/v1/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise UpError(
                    f"the mirror did not answer within {timeout:.0f}s; its last lines ({self.log_path}):\n{self.tail()}"
                )
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not running; only its parent (the agent, now gone) would reap it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def kill_leftovers(pids: set[int], timeout: float = 10.0) -> list[int]:
    """The last guard: engines the agent should have stopped and did not. Returns those it had to stop."""
    left = [p for p in pids if _alive(p)]
    for pid in left:
        try:
            os.killpg(pid, signal.SIGTERM)  # the supervisor gives each engine its own process group
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return left
