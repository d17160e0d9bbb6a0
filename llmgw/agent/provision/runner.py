"""Running commands for the installer, behind a seam tests can replace.

Every external program the installer starts (package managers, ``ldd``, the
engine's ``--version``, ``uv``) goes through a :class:`Runner`, so a test can
play a whole machine — a held apt lock, a library ldd cannot find — without
root or network.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    # stdout and stderr together, in the order written: the reason a tool
    # gives is usually on stderr, and the version line of llama-server too.
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Runner(Protocol):
    async def __call__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        timeout: float | None = None,
    ) -> CommandResult: ...


# Exit status used for "could not start" and "timed out", as a shell would.
NOT_FOUND = 127
TIMED_OUT = 124


async def run_command(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdin: str | None = None,
    timeout: float | None = None,
) -> CommandResult:
    """Run ``argv`` for real; ``env`` is added to the agent's environment.

    Never raises for the command's own failure: a missing program is exit 127
    and a timeout exit 124, each with words in ``output``.
    """
    full_env = {**os.environ, **env} if env else None
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=full_env,
            # Its own process group, so a timeout kills what it started too
            # (apt-get's dpkg, uv's build backends).
            start_new_session=True,
        )
    except FileNotFoundError:
        return CommandResult(NOT_FOUND, f"{argv[0]}: not found")
    except PermissionError as e:
        return CommandResult(NOT_FOUND, f"{argv[0]}: cannot be run ({e.strerror})")
    except OSError as e:
        # ENOEXEC and friends: a file that is not a program for this machine.
        return CommandResult(NOT_FOUND, f"{argv[0]}: cannot be run ({e.strerror or e})")
    try:
        out, _ = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None), timeout)
    except TimeoutError:
        _kill_group(proc)
        await proc.wait()
        return CommandResult(TIMED_OUT, f"{argv[0]} did not finish within {timeout:.0f} s")
    except asyncio.CancelledError:
        _kill_group(proc)
        raise
    return CommandResult(proc.returncode if proc.returncode is not None else -1, out.decode(errors="replace"))


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def last_lines(text: str, n: int = 4) -> str:
    """The last few non-empty lines joined on one line, for a status detail."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-n:])
