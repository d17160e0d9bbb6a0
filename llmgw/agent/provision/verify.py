"""Proving an installed engine runs: ``ldd``, ``--version``, and the marker.

Two checks, because they fail differently: ldd names a missing library
outright, where running the binary would only say it could not start; and
running it is the only proof that the rest (instruction set, driver) is in
place. An install directory is trusted only once both passed and the marker
was written, last, into it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from llmgw.files import write_atomic
from llmgw.paths import PathRefused, relative_path

from .llamacpp_source import sha256_file as sha256_file  # re-exported: the installers import it from here with the rest
from .runner import Runner, last_lines
from .status import ProvisionError

if TYPE_CHECKING:
    from .status import Reporter

log = logging.getLogger(__name__)

MARKER = ".llmgw-installed"
VERSION_TIMEOUT = 60.0

# What a person should be told about libraries that are commonly missing:
# the bare soname rarely says which package or fix it takes.
_LIBRARY_HINTS = {
    "libcuda.so.1": "the NVIDIA driver is not installed",
    "libnvidia-ml.so.1": "the NVIDIA driver is not installed",
    "libgomp.so.1": "install libgomp1 (Debian, Ubuntu) or libgomp (Red Hat family)",
    "libvulkan.so.1": "install libvulkan1 (Debian, Ubuntu) or vulkan-loader (Red Hat family)",
    "libcudart.so.12": "the CUDA runtime archive was not unpacked beside the binary",
    "libcublas.so.12": "the CUDA runtime archive was not unpacked beside the binary",
}

_NOT_FOUND = re.compile(r"^\s*(\S+)\s*=>\s*not found\s*$")
# The loader prefixes this one with the program's own path ("prog: lib: version ...").
_TOO_OLD = re.compile(r"(\S+):\s+version\s+[`'‘]([^'’`]+)['’`]\s+not found")


def ldd_findings(output: str) -> list[str]:
    """What ``ldd`` could not satisfy, as sentences; empty when all is found.

    Two shapes matter::

        libcuda.so.1 => not found
        /lib64/libstdc++.so.6: version `GLIBCXX_3.4.30' not found (required by ...)

    The second is a system too old for the build (RHEL 9 against a build
    that wants GCC 12's libstdc++) and is said as such, once, rather than as a
    library that is plainly installed being "not found".
    """
    seen: list[str] = []
    for line in output.splitlines():
        m = _TOO_OLD.search(line)
        if m:
            lib = PurePosixPath(m.group(1)).name
            what = f"{lib} is too old (needs {m.group(2)})"
        else:
            m = _NOT_FOUND.match(line)
            if not m:
                continue
            lib = m.group(1)
            hint = _LIBRARY_HINTS.get(lib)
            what = f"{lib} not found: {hint}" if hint else f"{lib} is not installed"
        if what not in seen:
            seen.append(what)
    return seen


def version_line(output: str) -> str:
    """The line of ``--version`` output worth showing a person."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        if "version" in ln.lower():
            return ln
    # `vllm --version` prints the bare number.
    for ln in lines:
        if ln[0].isdigit():
            return ln
    return lines[0] if lines else ""


def find_binary(tree: Path, name: str) -> Path:
    """The executable called ``name`` anywhere under ``tree`` (shallowest first)."""
    found = sorted(
        (p for p in tree.rglob(name) if p.is_file() and not p.is_symlink()),
        key=lambda p: (len(p.relative_to(tree).parts), str(p)),
    )
    if not found:
        raise ProvisionError(f"the build has no {name} in it")
    return found[0]


async def prove_runs(
    run: Runner,
    binary: Path,
    *,
    version_args: Sequence[str] = ("--version",),
    use_ldd: bool = True,
    timeout: float = VERSION_TIMEOUT,
) -> str:
    """ldd, then run ``binary`` with ``version_args``; returns the version line."""
    name = binary.name
    if not os.access(binary, os.X_OK):
        raise ProvisionError(f"{binary} is not executable")
    if use_ldd:
        r = await run(["ldd", str(binary)], timeout=30)
        # ldd fails on scripts and static binaries ("not a dynamic
        # executable") and may not exist at all; only what it names counts.
        findings = ldd_findings(r.output)
        if findings:
            raise ProvisionError(f"{name} cannot run on this system: " + "; ".join(findings))
    r = await run([str(binary), *version_args], timeout=timeout)
    if not r.ok:
        raise ProvisionError(
            f"`{name} {' '.join(version_args)}` failed (exit {r.returncode}): {last_lines(r.output) or 'no output'}"
        )
    return version_line(r.output)


# ------------------------------------------------------------------ marker


@dataclass
class Marker:
    engine: str
    version: str
    variant: str
    # Relative to the install directory.
    binary: str
    # Where it came from: "release", "source" or "uv".
    source: str
    version_line: str = ""
    # Each archive's sha256 as checked before unpacking.
    sha256: dict[str, str] = field(default_factory=dict)
    # The binary's own sha256, so a later check notices it was changed.
    binary_sha256: str = ""
    url: str = ""
    # Python engines: what was asked for, PyPI as of when, by which uv.
    requirements: list[str] = field(default_factory=list)
    exclude_newer: str = ""
    uv: str = ""
    installed: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Marker:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def now_utc() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_marker(tree: Path, marker: Marker) -> None:
    """Write the marker into ``tree``; call it last, after every check passed."""
    write_atomic(tree / MARKER, marker.to_json().encode("utf-8"))


def read_marker(install_dir: Path) -> Marker | None:
    """The marker of an installed directory; None when absent or unreadable."""
    try:
        return Marker.from_json((install_dir / MARKER).read_text())
    except (OSError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Installed:
    """An install directory with its marker."""

    dir: Path
    marker: Marker

    @property
    def binary(self) -> Path:
        return self.dir / self.marker.binary


def installed_at(install_dir: Path) -> Installed | None:
    m = read_marker(install_dir)
    if m is None:
        return None
    # The marker is ours, but the directory is on disk where anyone with
    # root could edit it; a binary path leaving it is not followed.
    try:
        relative_path(m.binary)
    except PathRefused:
        return None
    return Installed(install_dir, m)


async def still_runs(
    install_dir: Path, check: Callable[[Installed], Awaitable[str]], reporter: Reporter, *, logged: str, shown: str
) -> tuple[Installed, str] | None:
    """The install in ``install_dir`` and its version line if it is there and still runs.

    An install is checked again rather than believed (a library it needs can be
    removed by somebody's upgrade); one that no longer runs is said to be
    installed again, and None comes back so the caller does that."""
    existing = installed_at(install_dir)
    if existing is None:
        return None
    try:
        return existing, await check(existing)
    except ProvisionError as e:
        log.warning("installed %s no longer runs (%s); installing it again", logged, e)
        reporter.installing(f"the installed {shown} no longer runs ({e}); installing it again")
        return None


# ------------------------------------------------------------------ layout


def work_dir_beside(target: Path) -> Path:
    """A fresh scratch directory next to ``target`` (same filesystem, so rename works)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Scratch directories left by an agent that died mid-install.
    for stale in target.parent.glob(f".{target.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))


def move_into_place(tree: Path, target: Path) -> None:
    """Rename the finished ``tree`` to ``target``, replacing an old install."""
    old = None
    if target.exists() or target.is_symlink():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(tree, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
