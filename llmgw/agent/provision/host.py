"""The few facts about a machine that decide which build it gets.

Discovery (``llmgw.agent.discovery``) knows far more; the installer needs only
these, so they are a small value the agent fills from discovery, and tests
write by hand. :func:`detect` reads them directly for callers without
discovery (``llmgw doctor``, one-off use).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

NVIDIA_VERSION_FILE = Path("/proc/driver/nvidia/version")

# Debian's and Red Hat's packaging families, from /etc/os-release ID and
# ID_LIKE, so a derivative nobody listed (Pop!_OS, Oracle Linux) still works.
_DEB_IDS = {"debian", "ubuntu"}
_RPM_IDS = {"rhel", "fedora", "centos", "rocky", "almalinux", "suse", "opensuse", "sles", "ol", "amzn"}

_ARCH_ALIASES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass(frozen=True)
class HostFacts:
    # Go-style architecture name: amd64, arm64, or whatever else uname said.
    arch: str
    os_id: str = ""
    os_like: tuple[str, ...] = ()
    # The loaded NVIDIA kernel driver's version ("580.65.06"); "" when no
    # driver is loaded, which is what "this node has no NVIDIA GPU" means here.
    nvidia_driver: str = ""
    # The lowest compute capability among the GPUs (7.0 for a V100); None
    # when unknown.
    min_compute_capability: float | None = None
    # None when not known (then no slowness is predicted); empty when known
    # to have none of interest, as on QEMU's default CPU model.
    cpu_flags: frozenset[str] | None = None

    @property
    def family(self) -> str | None:
        """``deb``, ``rpm``, or None for a system of no family we know."""
        ids = [self.os_id, *self.os_like]
        if any(i in _DEB_IDS for i in ids):
            return "deb"
        if any(i in _RPM_IDS or i.startswith("opensuse") for i in ids):
            return "rpm"
        return None

    @property
    def has_nvidia_driver(self) -> bool:
        return bool(self.nvidia_driver)

    def has_cpu_flag(self, flag: str) -> bool:
        return self.cpu_flags is not None and flag in self.cpu_flags

    @classmethod
    def from_inventory(cls, host, gpus=()) -> HostFacts:
        """From discovery's ``protocol.Host`` and ``protocol.GPU`` list (read by
        attribute, so this module does not depend on their exact classes)."""
        caps = []
        for g in gpus or ():
            try:
                caps.append(float(getattr(g, "compute_capability", None) or ""))
            except ValueError:
                continue
        return cls(
            arch=normalise_arch(getattr(host, "arch", None) or platform.machine()),
            os_id=(getattr(host, "os_id", None) or "").lower(),
            os_like=tuple(w.lower() for w in getattr(host, "os_like", None) or ()),
            nvidia_driver=getattr(host, "nvidia_driver", None) or "",
            min_compute_capability=min(caps) if caps else None,
            cpu_flags=None if getattr(host, "cpu_flags", None) is None else frozenset(host.cpu_flags),
        )


def normalise_arch(machine: str) -> str:
    return _ARCH_ALIASES.get(machine.strip().lower(), machine.strip().lower())


def parse_os_release(text: str) -> tuple[str, tuple[str, ...]]:
    """``(ID, ID_LIKE words)`` from the text of /etc/os-release."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip().strip("\"'")
    return values.get("ID", "").lower(), tuple(values.get("ID_LIKE", "").lower().split())


def parse_nvidia_driver_version(text: str) -> str:
    """The driver version from /proc/driver/nvidia/version.

    Both the proprietary and the open kernel module say it on the NVRM line::

        NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024
        NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16-I3-B03-4-3)  ...
    """
    for line in text.splitlines():
        if line.startswith("NVRM"):
            m = re.search(r"\s(\d{3,}\.\d+(?:\.\d+)?)\s", line + " ")
            if m:
                return m.group(1)
    return ""


def parse_cpu_flags(cpuinfo: str) -> frozenset[str] | None:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        # x86 says "flags", arm64 says "Features".
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _min_compute_capability() -> float | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        r = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, timeout=15
        )
    except (OSError, subprocess.SubprocessError):
        return None
    caps = []
    for line in r.stdout.splitlines():
        try:
            caps.append(float(line.strip()))
        except ValueError:
            continue
    return min(caps) if caps else None


def detect(root: Path = Path("/")) -> HostFacts:
    """Read the facts from this machine (``root`` lets tests point at a fake tree)."""
    os_id, os_like = parse_os_release(_read(root / "etc/os-release"))
    version_file = root / NVIDIA_VERSION_FILE.relative_to("/")
    driver = ""
    if version_file.exists():
        # The file existing is what "a driver is loaded" means; a version we
        # cannot parse still counts as a driver.
        driver = parse_nvidia_driver_version(_read(version_file)) or "unknown"
    return HostFacts(
        arch=normalise_arch(platform.machine()),
        os_id=os_id,
        os_like=os_like,
        nvidia_driver=driver,
        min_compute_capability=_min_compute_capability() if driver and root == Path("/") else None,
        cpu_flags=parse_cpu_flags(_read(root / "proc/cpuinfo")),
    )
