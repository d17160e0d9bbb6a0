"""Installing operating-system packages with the machine's own package manager.

Only packages the machine lacks are installed, from its own package sources:
one it already has is never touched, so installing an engine never upgrades
something the rest of the machine depends on.

A machine a minute old is usually running cloud-init's and
unattended-upgrades' own apt. ``DPkg::Lock::Timeout`` makes apt wait for
dpkg's lock (``/var/lib/dpkg/lock-frontend``) but not for the one ``apt-get
update`` takes on its lists, so a command that fails only because another
holds a lock is tried again every ten seconds for up to ten minutes, and
reported as waiting rather than as a failure.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from .runner import Runner, last_lines, run_command
from .status import ProvisionError

LOCK_WAIT = 600.0
LOCK_RETRY = 10.0
# apt-get update on a slow mirror, a large dnf transaction: long, not forever.
COMMAND_TIMEOUT = 1800.0

# Said by a package manager that failed only because another holds its lock.
LOCK_MESSAGES = (
    "Unable to lock",  # apt: "Unable to lock directory /var/lib/apt/lists/"
    "Could not get lock",  # apt: "Could not get lock /var/lib/dpkg/lock-frontend. It is held by process N"
    "Unable to acquire the dpkg frontend lock",
    "is locked by another process",
    "waiting for process with pid",  # dnf
    "System management is locked",  # zypper
    "holding the yum lock",  # yum
)

# Said when the agent is not allowed to install at all; checked before the
# lock messages, because a non-root apt-get says both.
PERMISSION_MESSAGES = (
    "are you root",
    "Permission denied",
    "must be run as root",
    "Root privileges are required",
    "This command has to be run with superuser",
)

# A package name as the package managers accept it; anything else (spaces,
# options, shell syntax) is refused before a command is built from it.
_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_:~-]*")


@dataclass(frozen=True)
class Plan:
    tool: str
    commands: tuple[tuple[str, ...], ...]
    env: Mapping[str, str]


def check_names(packages: Sequence[str]) -> None:
    bad = [p for p in packages if not _PACKAGE.fullmatch(p)]
    if bad:
        raise ProvisionError(
            f"{', '.join(map(repr, bad))} is not a package name (letters, digits and . + _ : ~ - only)"
        )


def install_plan(family: str, packages: Sequence[str], which: Callable[[str], str | None]) -> Plan | None:
    """The commands that install ``packages`` on a machine of this family, or
    None when no package manager for it is present."""
    pkgs = tuple(packages)
    if family == "deb":
        if not which("apt-get"):
            return None
        # apt waits on dpkg's own lock for up to ten minutes by itself.
        lock = "-o=DPkg::Lock::Timeout=600"
        return Plan(
            "apt-get",
            (
                ("apt-get", lock, "update"),
                ("apt-get", lock, "install", "-y", "--no-install-recommends", *pkgs),
            ),
            {"DEBIAN_FRONTEND": "noninteractive"},
        )
    if family == "rpm":
        for tool in ("dnf", "yum"):
            if which(tool):
                return Plan(tool, ((tool, "install", "-y", *pkgs),), {})
        if which("zypper"):
            return Plan("zypper", (("zypper", "--non-interactive", "install", *pkgs),), {})
        return None
    return None


def lock_held(output: str) -> bool:
    return any(s.lower() in output.lower() for s in LOCK_MESSAGES)


def permission_denied(output: str) -> bool:
    return any(s.lower() in output.lower() for s in PERMISSION_MESSAGES)


class PackageInstaller:
    """Asks whether packages are installed and installs those missing.

    ``run`` executes commands (a fake in tests); ``which`` says whether a
    tool is on PATH; ``sleep`` and ``clock`` let a test wait ten minutes in
    no time.
    """

    def __init__(
        self,
        run: Runner = run_command,
        *,
        which: Callable[[str], str | None] = shutil.which,
        lock_wait: float = LOCK_WAIT,
        lock_retry: float = LOCK_RETRY,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run = run
        self.which = which
        self.lock_wait = lock_wait
        self.lock_retry = lock_retry
        self.sleep = sleep
        self.clock = clock
        # One package command at a time from this agent.
        self._lock = asyncio.Lock()

    async def is_installed(self, family: str, package: str) -> bool:
        if family == "deb":
            # dpkg -s succeeds for a package merely known about (removed but
            # not purged); the status abbreviation is "ii " only when installed.
            r = await self.run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}", package], timeout=30)
            return r.ok and r.output.startswith("ii")
        if family == "rpm":
            r = await self.run(["rpm", "-q", package], timeout=30)
            return r.ok
        return False

    async def missing(self, family: str, packages: Sequence[str]) -> list[str]:
        return [p for p in packages if not await self.is_installed(family, p)]

    async def ensure(
        self,
        family: str | None,
        by_family: Mapping[str, Sequence[str]],
        report: Callable[[str], None] | None = None,
    ) -> list[str]:
        """Install whichever of ``by_family[family]`` the machine lacks.

        Returns the packages installed. A family with nothing listed (or an
        unknown one) installs nothing: its packages may well be there, and if
        not, ldd names the missing library.
        """
        report = report or (lambda _detail: None)
        pkgs = list(by_family.get(family or "", ()))
        if not pkgs or family is None:
            return []
        check_names(pkgs)
        async with self._lock:
            return await self._ensure(family, pkgs, report)

    async def _ensure(self, family: str, pkgs: list[str], report: Callable[[str], None]) -> list[str]:
        missing = await self.missing(family, pkgs)
        if not missing:
            return []
        plan = install_plan(family, missing, self.which)
        if plan is None:
            tools = "apt-get" if family == "deb" else "dnf, yum or zypper"
            raise ProvisionError(
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                f"missing and no package manager ({tools}) was found to install it"
            )
        report(f"installing {', '.join(missing)} with {plan.tool}")
        for cmd in plan.commands:
            await self.run_waiting_for_lock(list(cmd), plan.env, report, missing)
        # Some tools exit 0 having installed nothing (zypper with a package
        # it cannot find in some modes); the query decides.
        still = await self.missing(family, missing)
        if still:
            raise ProvisionError(
                f"{plan.tool} finished but {', '.join(still)} is still not installed; "
                "check the machine's package sources"
            )
        return missing

    async def run_waiting_for_lock(
        self, cmd: list[str], env: Mapping[str, str], report: Callable[[str], None], packages: Sequence[str] = ()
    ) -> None:
        deadline = self.clock() + self.lock_wait
        started = self.clock()
        while True:
            r = await self.run(cmd, env=env, timeout=COMMAND_TIMEOUT)
            if r.ok:
                return
            if permission_denied(r.output):
                raise ProvisionError(
                    f"{cmd[0]} needs root to install {', '.join(packages) or 'packages'}: run the "
                    f"agent as root, or install them by hand ({last_lines(r.output, 2)})"
                )
            if not lock_held(r.output):
                raise ProvisionError(
                    f"`{' '.join(cmd)}` failed (exit {r.returncode}): {last_lines(r.output) or 'no output'}"
                )
            if self.clock() >= deadline:
                raise ProvisionError(
                    f"another {cmd[0]} held the package lock for more than "
                    f"{self.lock_wait / 60:.0f} minutes; it is tried again on the next pass "
                    f"({last_lines(r.output, 1)})"
                )
            waited = self.clock() - started
            report(
                f"waiting for another {cmd[0]} to finish (a new machine runs its own "
                f"updates first; waited {waited:.0f} s of {self.lock_wait:.0f})"
            )
            await self.sleep(self.lock_retry)
