"""Running the external tools discovery reads (nvidia-smi, ip, systemctl).

Every command runs with a timeout: a wedged driver makes nvidia-smi hang, and
a hung discovery is a node that never registers. A tool that is not installed
is normal (a node without GPUs has no nvidia-smi) and is reported as such,
not raised.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: did not run to completion (missing, timed out)
    stdout: str = ""
    stderr: str = ""
    missing: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe_failure(self) -> str:
        """Words for why the command gave nothing usable."""
        name = self.argv[0] if self.argv else "command"
        if self.missing:
            return f"{name} is not installed (or not at that path)"
        if self.timed_out:
            return f"`{' '.join(self.argv)}` did not finish in time"
        text = (self.stderr.strip() or self.stdout.strip()).splitlines()
        said = f": {text[-1][:300]}" if text else ""
        return f"`{' '.join(self.argv)}` exited with status {self.returncode}{said}"


Runner = Callable[[Sequence[str], float], CommandResult]
Which = Callable[[str], "str | None"]


def run_command(argv: Sequence[str], timeout: float) -> CommandResult:
    """Run ``argv`` without a shell, capturing text output, for at most ``timeout`` seconds."""
    args = tuple(argv)
    try:
        proc = subprocess.run(
            args,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            # A fixed, English locale: the parsers read the tools' words.
            env={**os.environ, "LC_ALL": "C"},
            check=False,
        )
    except FileNotFoundError:
        return CommandResult(args, None, missing=True)
    except PermissionError as exc:
        return CommandResult(args, None, stderr=str(exc))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return CommandResult(args, None, stdout=out, timed_out=True)
    return CommandResult(args, proc.returncode, proc.stdout, proc.stderr)


def which(name: str) -> str | None:
    return shutil.which(name)


# Where root's tools live: Debian leaves /usr/sbin off a user's (and a service's)
# PATH, and infiniband-diags installs there on some distributions.
SBIN_DIRS: tuple[Path, ...] = (Path("/usr/sbin"), Path("/sbin"))


def find_tool(
    name: str, which: Callable[[str], str | None] = which, sbin_dirs: Sequence[Path] | None = None
) -> str | None:
    """A tool on PATH, else in the sbin directories (doctor and the agent look alike)."""
    found = which(name)
    if found:
        return found
    dirs = SBIN_DIRS if sbin_dirs is None else sbin_dirs
    return next((str(d / name) for d in dirs if (d / name).is_file() and os.access(d / name, os.X_OK)), None)
